"""Routing glue as few fused GPU passes: router logits, gated residual updates, expert choice.

Profiling a 100M dynamic training step (B=8, T=2048, H100, the whole step CUDA-graphed, so GPU
time is all that counts) showed the routing glue — router logits on the RMS-normalised fp32
stream, the gate · update residual adds and scatters, the top-k bookkeeping — costing more GPU
time than the routed blocks save: ~25 small elementwise passes over the [B, n, E] fp32 stream per
routing point in forward and backward, at 38 routing points per step. Each function here is the
same maths written once; on CUDA it runs through ``torch.compile`` (dynamic shapes, one compile
per function for every routed length), which fuses each into one or two kernels forward and
backward; elsewhere (CPU, or when switched off) it runs as written, op by op.

ON by default on CUDA; ``HYDRA_COMPILED_ROUTING=0`` (read at import into
hydra_model.options.OPTIONS) or
:func:`set_compiled_routing` switches it off. Measured on the H100 (100M, B=8, T=2048, the whole
step CUDA-graphed, same run): 74.2 ms per step against 89.7 ms op by op (220.8K vs 182.7K
tokens/s) and 11.6 vs 12.7 GiB peak, replayed loss equal to eager; the price is the first
compile of the functions, ~90 s on a cold inductor cache (BENCHMARKS.md). Calls per path are
counted (:func:`compiled_routing_counts`). Inside an outer ``torch.compile`` the plain functions
are traced into the caller's graph instead.

Only calls with gradients enabled (training) take the compiled path; no-grad calls (validation,
generation) run op by op, but for the router logits: one hydra_kernels kernel (``router_logit``).
Each dispatch name compiles its own copy of the function's code: torch.compile keeps its graphs,
and its limit of 8 recompiles, per code object, and on the H100 a training run's mix of grad
modes, routed lengths and ``with_detached`` variants on the one shared ``_router_logits``
reached that limit (counted as a failure, and op by op from then on).
"""

from __future__ import annotations

import math
import threading
import types
import warnings
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hydra_kernels.ops.router_logit import router_logit
from hydra_model.options import OPTIONS

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_compiled: dict[str, Callable | None] = {}  # None: its compile failed, run op by op
_NOT_YET = object()


def set_compiled_routing(enabled: bool) -> None:
    """Run the routing glue through torch.compile on CUDA (True, the default) or op by op (False).
    CPU tensors always run op by op."""
    OPTIONS.compiled_routing = bool(enabled)


def compiled_routing_enabled() -> bool:
    return bool(OPTIONS.compiled_routing)


def compiled_routing_counts() -> dict[str, int]:
    """Calls per function and path ("<name>:compiled" or "<name>:eager") since import."""
    return dict(_counts)


#: what the compiled path compiles with, and for which tensors (tests widen both to the CPU)
_COMPILE_BACKEND = "inductor"


def _compile_here(t: torch.Tensor) -> bool:
    return t.is_cuda


def _wants_compiled(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` takes the compiled path: switched on, a training call (gradients
    enabled) and a device it compiles for. The one place this rule lives."""
    return OPTIONS.compiled_routing and torch.is_grad_enabled() and _compile_here(t)


def _own_code_copy(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own, so that torch.compile's per-code cache and recompile
    limit are per dispatch name, not shared by every name that runs the same function."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{name}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _dispatch(name: str, fn: Callable, *args):
    """``fn(*args)``, through its compiled twin when enabled, on CUDA, with gradients enabled and
    not already tracing. A compile that fails is counted ("<name>:failed"), warned about once,
    and that function runs op by op from then on (a broken compiler never silently changes
    results)."""
    if torch.compiler.is_compiling():
        return fn(*args)
    compiled = _compiled.get(name, _NOT_YET) if _wants_compiled(args[0]) else None
    if compiled is _NOT_YET:
        with _lock:
            if name not in _compiled:
                _compiled[name] = torch.compile(
                    _own_code_copy(fn, name), backend=_COMPILE_BACKEND, dynamic=True, fullgraph=True
                )
            compiled = _compiled[name]
    if compiled is not None:
        try:
            out = compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            _counts[f"{name}:failed"] += 1
            _compiled[name] = None
            warnings.warn(
                f"hydra_model: compiling the routing function {name} failed ({type(exc).__name__}: "
                f"{str(exc)[:300]}); it runs op by op from now on (slower, same maths)",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            _counts[f"{name}:compiled"] += 1
            return out
    _counts[f"{name}:eager"] += 1
    return fn(*args)


# --- router logits ----------------------------------------------------------------------------


def _router_logits(h, weight, bias, eps: float, with_detached: bool):
    # No autocast context here, unlike the eager form: every op below is elementwise or a
    # reduction on fp32 (fp64) tensors, which autocast leaves as they are (it recasts matmuls and
    # the like, and never doubles), so the values are the same; and a `with torch.autocast` in a
    # traced forward puts _enter_autocast nodes in the graph, which makes torch skip its
    # AOTAutograd cache for the whole compiled model (a warm compile traced the joint graph again)
    ct = torch.promote_types(h.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    hf, w, b = h.to(ct), weight.to(ct), bias.to(ct)
    inv = torch.rsqrt(hf.pow(2).mean(-1) + eps)  # [B, n]
    # a product-and-sum reduction rather than a matrix-vector product: compiled, it fuses
    # with the norm's reduction into one read of h
    logit = (hf * w).sum(-1) * inv + b
    if not with_detached:
        return logit, None
    detached = (hf.detach() * w).sum(-1) * inv.detach() + b
    return logit, detached


def _router_logits_eager(h, weight, bias, eps: float, with_detached: bool):
    with torch.autocast(h.device.type, enabled=False):
        ct = torch.promote_types(h.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        hf, w, b = h.to(ct), weight.to(ct), bias.to(ct)
        inv = torch.rsqrt(hf.pow(2).mean(-1) + eps)
        logit = torch.addcmul(b, hf @ w, inv)  # op by op a matrix-vector product reads h once
        if not with_detached:
            return logit, None
        detached = torch.addcmul(b, hf.detach() @ w, inv.detach())
    return logit, detached


def router_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6, with_detached: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear router on the RMS-normalised stream, without materialising the normalised copy:
    ``(h·w)·rsqrt(mean(h²) + eps) + b`` for h [B, n, E], w [E], b [] → two [B, n] fp32 logits of
    equal value: the first differentiable in h, w, b (gates: the router learns from the LM loss),
    the second only in w, b (its BCE teaches membership from the token alone, as a router on a
    detached input would; None unless ``with_detached``). fp32, outside autocast: top-k
    decisions compare these."""
    if torch.compiler.is_compiling():
        return _router_logits(h, weight, bias, eps, with_detached)
    if _wants_compiled(h):
        name = "router_logits" if with_detached else "router_logit"
        return _dispatch(name, _router_logits, h, weight, bias, eps, with_detached)
    if not (with_detached or torch.is_grad_enabled()):
        # evaluation, a prompt's prefill: one kernel (hydra_kernels' router_logit), not nine
        _counts["router_logits:no_grad"] += 1
        return router_logit(h.reshape(-1, h.shape[-1]), weight, bias, eps).view(h.shape[:-1]), None
    _counts["router_logits:eager"] += 1
    return _router_logits_eager(h, weight, bias, eps, with_detached)


# --- gated residual updates -------------------------------------------------------------------


def _gated_residual(h, gate, delta):
    return torch.addcmul(h, gate.unsqueeze(-1).to(h.dtype), delta.to(h.dtype))


def gated_residual(h: torch.Tensor, gate: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``h + gate[..., None] · delta`` in h's dtype: h [B, n, E], gate [B, n], delta [B, n, E]."""
    return _dispatch("gated_residual", _gated_residual, h, gate, delta)


def _gated_mix(h, gate, h_out):
    return torch.lerp(h, h_out.to(h.dtype), gate.unsqueeze(-1).to(h.dtype))


def gated_mix(h: torch.Tensor, gate: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """``h + gate[..., None] · (h_out − h)``: h, h_out [B, n, E], gate [B, n]."""
    return _dispatch("gated_mix", _gated_mix, h, gate, h_out)


def _gated_scatter(h, flat, idx, gate, update, base):
    b, n, e = h.shape
    rows = gate.gather(1, idx).unsqueeze(-1).to(h.dtype)  # [B, m, 1]
    upd = update.to(h.dtype) if base is None else update.to(h.dtype) - base.to(h.dtype)
    return h.reshape(b * n, e).index_add(0, flat, (rows * upd).reshape(-1, e)).view(b, n, e)


def _gated_scatter_nobase(h, flat, idx, gate, update):
    return _gated_scatter(h, flat, idx, gate, update, None)


def gated_scatter(
    h: torch.Tensor,
    flat: torch.Tensor,
    idx: torch.Tensor,
    gate: torch.Tensor,
    update: torch.Tensor,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [B, n, E] with ``gate[b, idx[b, j]] · (update − base)[b, j]`` added at row idx[b, j]
    (distinct per sequence; ``flat`` = the same rows of h flattened to [B·n, E]); out of place.
    ``update``/``base`` [B, m, E]; ``base`` None means 0."""
    if base is None:
        return _dispatch("gated_scatter", _gated_scatter_nobase, h, flat, idx, gate, update)
    return _dispatch("gated_scatter_delta", _gated_scatter, h, flat, idx, gate, update, base)


# --- expert-choice bookkeeping ----------------------------------------------------------------


def _expert_choice_select(logit, bce_logit, active, pos, reach, depth, expected, k: int, alpha: float):
    """One training-mode expert-choice recursion's decisions and bookkeeping (see the caller)."""
    b, n = logit.shape
    prob = torch.sigmoid(logit)
    gate = alpha * prob
    count = b * n if active is None else None
    mask = torch.ones_like(logit) if active is None else active.to(logit.dtype)
    denom = mask.sum() if count is None else count
    router_z = (logit.pow(2) * mask).sum() / denom
    scores = logit.detach() if active is None else logit.detach().masked_fill(~active, -math.inf)
    idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values  # [B, k], time order
    selected = torch.zeros_like(logit, dtype=torch.bool).scatter(1, idx, True)
    bce = F.binary_cross_entropy_with_logits(bce_logit, selected.to(bce_logit.dtype), reduction="none")
    bce = (bce * mask).sum() / denom
    reach = reach * prob
    flat = (idx + torch.arange(b, device=idx.device).unsqueeze(1) * n).reshape(-1)
    return (
        gate,
        idx,
        flat,
        pos.gather(1, idx),
        selected,
        router_z,
        bce,
        reach,
        depth + selected,
        expected + reach,
    )


def _expert_choice_select_all(logit, bce_logit, pos, reach, depth, expected, k: int, alpha: float):
    return _expert_choice_select(logit, bce_logit, None, pos, reach, depth, expected, k, alpha)


def expert_choice_select(
    logit: torch.Tensor,
    bce_logit: torch.Tensor,
    active: torch.Tensor | None,
    pos: torch.Tensor,
    reach: torch.Tensor,
    depth: torch.Tensor,
    expected: torch.Tensor,
    k: int,
    alpha: float,
) -> tuple[torch.Tensor, ...]:
    """Training-mode expert choice for one recursion, from its router logits [B, n]: the top k of
    the still-``active`` tokens (all when None) in time order. Returns (gate [B, n], idx [B, k],
    flat [B·k], positions of idx [B, k], selected [B, n] bool, router z-loss, membership BCE,
    reach, depth, expected) — the last three updated running [B, n] statistics."""
    if active is None:
        args = (logit, bce_logit, pos, reach, depth, expected, k, alpha)
        return _dispatch("expert_choice_all", _expert_choice_select_all, *args)
    return _dispatch(
        "expert_choice",
        _expert_choice_select,
        logit,
        bce_logit,
        active,
        pos,
        reach,
        depth,
        expected,
        k,
        alpha,
    )
