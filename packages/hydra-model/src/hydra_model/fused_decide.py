"""A MoD point's decode-time causal decision as one kernel (``hydra_kernels.router_decide``).

Why: at batch 1 a graphed decode step is bound by kernel launches (~4 µs each on an H100), and
the causal rule's decision for one decoded token, op by op (routing_causal.py's
``decode_decide``: router_logits, sigmoid, ``CausalRouter.decide``, then the decoder's copies
into its held buffers and flag), is some twenty of them per routed block. The fused op computes
the same logit (fp32, the RMS-normalised stream, router_logits' eps), σ(logit), the threshold and
budget test and the counter update, and writes taken, weight and the flag straight into the
decoder's buffers: one launch, nothing allocated, no host read, so it is captured like any kernel.

When it runs (:func:`fused_decide_applies`; switch with :func:`set_fused_decide` or the
:func:`fused_decide` context, or ``HYDRA_FUSED_DECIDE`` read at import):

- ``auto`` (default): h on CUDA while hydra_kernels' Triton kernels are on — the decode steps a
  GPU runs. Everything else (the CPU in particular) keeps the op-by-op PyTorch path.
- ``on``: wherever the decision can be fused at all; the op then runs its Triton kernel where
  hydra_kernels can (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and its PyTorch reference
  elsewhere. For tests and for ``hydra-diag``'s decode kernel count, which run on the CPU.
- ``off``: never.

In every mode it stays off for fp64 streams (the kernel computes in fp32) and for a decision that
autograd would have to differentiate (the fused op has no backward).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator

import torch
from torch import nn

from hydra_kernels import controls
from hydra_kernels.ops.router_decide import router_decide
from hydra_model.causal_routing import CAPACITY_BITS, CAPACITY_ONE, CausalRouter
from hydra_model.fused_routing import router_logits

FUSED_DECIDE_MODES = ("auto", "on", "off")

#: the norm's eps of the unfused path (router_logits' default, which decode_decide relies on)
ROUTER_EPS: float = inspect.signature(router_logits).parameters["eps"].default

_FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _mode_from_env() -> str:
    mode = os.environ.get("HYDRA_FUSED_DECIDE", "").strip().lower() or "auto"
    if mode not in FUSED_DECIDE_MODES:
        raise ValueError(f"HYDRA_FUSED_DECIDE={mode!r}; expected one of {', '.join(FUSED_DECIDE_MODES)}")
    return mode


_mode = _mode_from_env()


def set_fused_decide(mode: str) -> None:
    """When a decode step's routing decision runs as one kernel: ``auto``, ``on`` or ``off``."""
    global _mode
    if mode not in FUSED_DECIDE_MODES:
        raise ValueError(f"fused decide mode {mode!r}; expected one of {', '.join(FUSED_DECIDE_MODES)}")
    _mode = mode


def fused_decide_mode() -> str:
    return _mode


@contextlib.contextmanager
def fused_decide(mode: str) -> Iterator[None]:
    """:func:`set_fused_decide` for the duration of a ``with`` block (read at each decision, so a
    decoder built outside the block follows it inside)."""
    was = _mode
    set_fused_decide(mode)
    try:
        yield
    finally:
        set_fused_decide(was)


def fused_decide_applies(
    h: torch.Tensor, pos: torch.Tensor | None, params: tuple[torch.Tensor, ...] = ()
) -> bool:
    """Whether the decision on the decoded stream h [B, 1, E] at positions pos [B, 1] runs fused
    (see the module docstring); ``params``: the router's weight and bias (autograd check)."""
    if _mode == "off" or pos is None or h.dim() != 3 or h.shape[1] != 1 or h.dtype not in _FUSABLE_DTYPES:
        return False
    if h.stride(-1) != 1 or pos.dtype != torch.long or pos.shape != (h.shape[0], 1):
        return False  # layouts the kernel does not read (copying them would allocate mid-graph)
    if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in params)):
        return False
    if _mode == "auto":
        return h.is_cuda and controls.use_triton_kernels() and controls.device_supports_triton(h.device)
    return True


def decision_buffers(
    h: torch.Tensor, flag: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh, unset (taken [B, 1] bool, weight [B, 1], flag [] bool) for a decision on h [B, 1, E]
    to be written into (empty, not zeroed: a fill is a kernel launch too); weight has
    router_logits' dtype (fp32 for half and fp32 streams). ``flag``: a 0-d bool to use instead of
    a new one (a slot of the decoder's flag vector, decode_graphs.py)."""
    b, dev = h.shape[0], h.device
    return (
        torch.empty(b, 1, dtype=torch.bool, device=dev),
        torch.empty(b, 1, dtype=torch.promote_types(h.dtype, torch.float32), device=dev),
        torch.empty((), dtype=torch.bool, device=dev) if flag is None else flag,
    )


def decide_into(
    router: CausalRouter,
    linear: nn.Linear,
    h: torch.Tensor,
    pos: torch.Tensor,
    counts: dict,
    taken: torch.Tensor,
    weight: torch.Tensor,
    flag: torch.Tensor,
    row: int = 0,
) -> None:
    """The causal decision of ``router`` on router ``linear``'s output ``row`` for h [B, 1, E] at
    positions pos [B, 1], in one launch: taken [B, 1] bool, weight [B, 1] = σ(logit) and flag []
    = any(taken) are written in place, and the router's counter in ``counts`` advances where
    taken (created at zero once if absent, as ``CausalRouter.decide`` does; in place after)."""
    count = counts.get(router.key)
    if count is None:
        count = counts[router.key] = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)  # [B]
    router_decide(
        h[:, 0],  # [B, E], rows strided by the stream's sequence stride
        linear.weight[row],  # [E]
        linear.bias[row],  # []
        router.threshold.tau,  # []
        pos[:, 0],  # [B]
        count,
        router.cap_q,
        CAPACITY_BITS,
        CAPACITY_ONE,
        ROUTER_EPS,
        taken[:, 0],  # [B] views of the caller's [B, 1] buffers
        weight[:, 0],
        flag,
    )
