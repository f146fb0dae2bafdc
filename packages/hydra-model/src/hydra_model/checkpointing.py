"""Gradient checkpointing for models made of a list of blocks."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from torch.utils.checkpoint import checkpoint


class GradientCheckpointMixin:
    """Adds ``enable_gradient_checkpointing(every=N)``: every N-th block (0, N, 2N, …) keeps only
    its input during the forward and recomputes its activations in the backward.

    Recomputation must reproduce the forward exactly: the blocks it wraps are deterministic
    (no dropout; top-k routing is a function of the inputs) and the RNG state is restored anyway
    (``preserve_rng_state``), so loss and gradients equal those without checkpointing.
    """

    _checkpoint_every: int = 0

    def enable_gradient_checkpointing(self, every: int = 1) -> None:
        try:  # an int (numpy's too); every=1.5 was taken as 1
            n = operator.index(every)
        except TypeError:
            raise TypeError(f"every={every!r} must be an int (1 checkpoints every block)") from None
        if n < 1:
            raise ValueError(f"every={every} must be ≥ 1 (1 checkpoints every block)")
        self._checkpoint_every = n

    def disable_gradient_checkpointing(self) -> None:
        self._checkpoint_every = 0

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpoint_every > 0

    def checkpointed_call(self, index: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, checkpointed when training and ``index`` is one of the chosen blocks."""
        every = self._checkpoint_every
        if every and getattr(self, "training", False) and index % every == 0:
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
        return fn(*args)
