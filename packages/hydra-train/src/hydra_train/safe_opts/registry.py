"""The optimization interface, the status words, and the registry of the nine optimizations.

An :class:`Optimization` is applied to a built run, as a model or optimizer converter is: it acts
on a :class:`hydra_train.trainer.Trainer` (the training one, or the throwaway one a pretest builds
around the same model) through the trainer's seams: ``trainer.forward_model``,
``trainer.enable_cuda_graphs``, ``trainer.set_optimizer``, ``trainer.loader``, the model's
modules, and the process-wide switches of hydra-kernels and hydra-model. It never replaces the
trainer's step. ``activate`` turns the fast path on and ``deactivate`` puts the safe default back,
for real; both are idempotent, so "establish the safe defaults" is simply ``deactivate`` on
everything.

Status words (what ``SafeOptimizations status: {...}`` prints):

=============  ===========================================================================
``OFF``        not requested
``N/A``        requested but not applicable here, or its pretest arm ran the reference's own
               code (:meth:`Optimization.no_effect`): reason recorded; never a failure
``PENDING``    requested, not decided yet (before the pretests)
``FAILED``     its pretest failed (reason recorded); the safe default runs
``ENABLED``    active, inside its safety window
``STABLE``     active, graduated after ``safety_window`` clean steps
``SUSPENDED``  switched off for an isolation trial (see :mod:`hydra_train.safe_opts.attribution`)
``DISABLED``   switched off mid-run by the monitor (reason recorded)
=============  ===========================================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from hydra_train.config import TrainConfig

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer

OFF, NA, PENDING, FAILED = "OFF", "N/A", "PENDING", "FAILED"
ENABLED, STABLE, SUSPENDED, DISABLED = "ENABLED", "STABLE", "SUSPENDED", "DISABLED"
ACTIVE_STATES = frozenset({ENABLED, STABLE})

#: Anomaly kinds the monitor reports.
LOSS_SPIKE, NAN_GRAD, INF_GRAD, NAN_LOSS, THROUGHPUT_DROP = (
    "loss_spike",
    "nan_grad",
    "inf_grad",
    "nan_loss",
    "throughput_drop",
)
ANOMALY_KINDS = (LOSS_SPIKE, NAN_GRAD, INF_GRAD, NAN_LOSS, THROUGHPUT_DROP)

#: Registry order = risk order, most likely to break numerics first. Attribution breaks ties
#: between suspects activated at the same step in this order.
NAMES = (
    "fp8",
    "cuda_graphs",
    "compile",
    "8bit_adam",
    "triton_kernels",
    "fa3",
    "static_routing",
    "blackwell_tuning",
    "prefetch_threads",
)


class Optimization(ABC):
    """One optional optimization. Subclasses set the class attributes and the three methods."""

    name: str = ""
    flag: str = ""  # the CLI flag that requests it
    title: str = ""  # one line for tables
    #: anomaly kinds this optimization can cause; anomalies of other kinds are never blamed on it
    causes: frozenset[str] = frozenset(ANOMALY_KINDS)
    #: pretest numerics rule: "equivalent" (same function: loss and gradients compared with the
    #: safe default), "fp8" (same, with the stated looser FP8 term), "mode" (a different function:
    #: finite and loss close, no gradient comparison, speed recorded but not judged)
    numerics: str = "equivalent"
    #: pretest: "start" activates before the first step; "after_warmup" after the untimed steps
    #: (so that an optimizer conversion carries real state)
    pretest_activation: str = "start"
    #: extra untimed pretest steps this optimization needs (a CUDA-graph capture step)
    pretest_extra_warmup: int = 0
    #: whether its step-0 forward/backward can differ from the default's at all (a CUDA graph is
    #: eager until captured; an optimizer or a loader does not touch the forward)
    probe_differs: bool = True
    #: optimizations this one's pretest arm runs on top of, those of them that passed their own
    #: pretest: its arm then has them on too and is judged against them (torch.compile traces
    #: the kernels' and attention's switches, so compiled on top of them its code is the run's)
    pretest_on_top_of: tuple[str, ...] = ()

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.active = False

    @abstractmethod
    def requested(self) -> bool:
        """Whether the run's flags ask for this optimization."""

    def not_applicable(self, trainer: Trainer) -> str | None:
        """Why this cannot run here (an N/A reason), or None when it can."""
        return None

    @abstractmethod
    def activate(self, trainer: Trainer) -> None:
        """Switch the real code path on for ``trainer``."""

    @abstractmethod
    def deactivate(self, trainer: Trainer) -> None:
        """Go back to the safe default for real."""

    def invalidate(self, trainer: Trainer) -> None:  # noqa: B027 - a no-op hook by default
        """Another optimization changed what the step computes (CUDA graphs recapture)."""

    def describe(self) -> dict[str, Any]:
        """Settings worth recording beside a pretest result."""
        return {}

    def no_effect(self, described: dict[str, Any]) -> str | None:
        """Why its pretest arm ran exactly what the reference arm runs (an N/A reason: its timing
        can only be noise), from what its ``describe()`` said at the end of the arm; None when it
        changed something."""
        return None


def build_registry(cfg: TrainConfig) -> dict[str, Optimization]:
    """All nine optimizations, in risk order, configured from ``cfg``."""
    from hydra_train.safe_opts.adam8bit import EightBitAdam
    from hydra_train.safe_opts.cuda_graphs import CudaGraphs
    from hydra_train.safe_opts.fp8 import Fp8Matmuls
    from hydra_train.safe_opts.toggles import (
        BlackwellTuning,
        CompileModel,
        FlashAttention,
        PrefetchThreads,
        StaticRouting,
        TritonKernels,
    )

    classes = (
        Fp8Matmuls,
        CudaGraphs,
        CompileModel,
        EightBitAdam,
        TritonKernels,
        FlashAttention,
        StaticRouting,
        BlackwellTuning,
        PrefetchThreads,
    )
    reg = {c.name: c(cfg) for c in classes}
    assert tuple(reg) == NAMES
    return reg
