"""flexible_attention: causal GQA attention on the fastest backend that is present and valid.

Backends: ``flash`` (flash-attn 2/3 when importable), ``xformers``, ``sdpa`` (PyTorch's
scaled_dot_product_attention and its cuDNN / flash / efficient kernels), and ``auto``.

``auto`` on CUDA measures, once per shape signature, every candidate that is importable and valid
(forward+backward when gradients are needed) and keeps the fastest on the GPU's own time (the step
it serves runs compiled and graphed, without the host's share); the choice is logged once and
cached. Off CUDA ``auto`` is plain SDPA. Under torch.compile or CUDA-graph capture nothing can be
measured: ``auto`` takes the backend measured most often for the same heads and head size (any
batch and length, so run one eager step first), else plain SDPA, counted as a fallback.

GQA never copies K/V where the backend takes grouped heads natively (SDPA ``enable_gqa``,
flash-attn, xformers' grouped layout); candidates that need copies are measured as separate
"+expand" variants, so the copy only wins when it is actually faster.

Environment: ``HYDRA_ATTENTION_BACKEND`` (auto|flash|xformers|sdpa), ``HYDRA_SDPA_FLASH_ONLY=1``
(SDPA restricted to its flash kernel), ``HYDRA_SDPA_NO_FLASH=1`` (SDPA without its flash kernel).
A requested backend that cannot run a call falls back to SDPA and is counted per reason
(:func:`attention_fallback_counts`).

The backends' implementations are in ``attention_impls.py`` and auto's timing of a candidate in
``attention_timing.py``; this module chooses among them and holds the choices and counts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch

from hydra_model import options
from hydra_model.attention_impls import (  # noqa: F401 (the *_AVAILABLE flags: re-exported)
    FLASH_ATTN_AVAILABLE,
    XFORMERS_AVAILABLE,
    SDPBackend,
    _invalid_reason,
    _run_flash,
    _run_sdpa,
    _run_xformers,
)
from hydra_model.attention_timing import (  # noqa: F401 (_gpu_ms, _time_calls: for the bench script)
    _gpu_ms,
    _time_calls,
    _time_candidate,
)
from hydra_model.compile_cache import vouch_for_sdpa_kernel_context
from hydra_model.options import BACKENDS, OPTIONS

logger = logging.getLogger(__name__)

vouch_for_sdpa_kernel_context()  # a restricted pick's compiled graphs stay cacheable

_lock = threading.Lock()
_fallbacks: Counter[str] = Counter()
_auto_choice: dict[tuple, str] = {}
_auto_report: dict[tuple, dict[str, float | str]] = {}


def reload_attention_env() -> None:
    """Re-read HYDRA_ATTENTION_BACKEND, HYDRA_SDPA_FLASH_ONLY and HYDRA_SDPA_NO_FLASH (into
    hydra_model.options.OPTIONS) and forget auto's measured choices and their reports."""
    options.reload_env()
    _auto_choice.clear()
    _auto_report.clear()


def set_attention_backend(name: str) -> None:
    """Use ``name`` (auto|flash|xformers|sdpa) from now on. auto's measured choices are kept: they
    depend on the shapes, the machine and the SDPA switches (:func:`reload_attention_env` forgets
    them), not on which backend was requested in between. Forgetting them here made every switch
    back to auto (hydra-train's fa3 pretest arm does one before its compile arm) trace the whole
    forward unmeasured, and the run compiled it a second time once a measurement came in."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    OPTIONS.attention_backend = name


def get_attention_backend() -> str:
    """The requested backend (what :func:`set_attention_backend` or the environment asked for)."""
    return str(OPTIONS.attention_backend)


def attention_fallback_counts() -> dict[str, int]:
    """Calls that could not run on the requested backend, per ``"<requested>-><used>: reason"``."""
    return dict(_fallbacks)


def reset_attention_fallback_counts() -> None:
    _fallbacks.clear()


def attention_autotune_report() -> dict[str, dict[str, float | str]]:
    """auto's measurements: per signature, each candidate's median ms (or its error) and the pick."""
    return {_describe(sig): dict(rep) for sig, rep in _auto_report.items()}


def _count(key: str) -> None:
    if not torch.compiler.is_compiling():
        with _lock:
            _fallbacks[key] += 1


def _describe(sig: tuple) -> str:
    dev, dtype, b, hq, hkv, s, length, d, causal, grad = sig
    return f"{dev} {dtype} B={b} Hq={hq} Hkv={hkv} S={s} L={length} d={d} causal={causal} grad={grad}"


# --- the implementations, all on [B, H, S, d]: attention_impls.py ----------------------------


_Impl = Callable[..., torch.Tensor]


def _candidates(q: torch.Tensor, k: torch.Tensor) -> dict[str, _Impl]:
    """auto's candidates for these inputs (CUDA only)."""
    gqa = q.shape[1] != k.shape[1]
    out: dict[str, _Impl] = {"sdpa": lambda *a: _run_sdpa(*a)}
    if SDPBackend is not None and not OPTIONS.sdpa_flash_only:
        kernels = ["cudnn", "efficient"] + ([] if OPTIONS.sdpa_no_flash else ["flash"])
        for kern in kernels:
            out[f"sdpa_{kern}"] = lambda *a, _k=kern: _run_sdpa(*a, restrict=_k)
            if gqa:
                out[f"sdpa_{kern}+expand"] = lambda *a, _k=kern: _run_sdpa(*a, restrict=_k, expand=True)
    if _invalid_reason("flash", q, None) is None:
        out["flash"] = _run_flash
    if _invalid_reason("xformers", q, None) is None:
        out["xformers"] = _run_xformers
    return out


def _measure(sig: tuple, q, k, v, causal, scale, needs_grad: bool) -> str:
    """Time every candidate on fresh random inputs of this shape; cache and log the fastest."""
    report: dict[str, float | str] = {}
    with torch.no_grad():
        tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
    # identity saved-tensor hooks: inside a checkpointed forward, the checkpoint's own hooks
    # would otherwise capture this private graph's saved tensors
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for name, impl in _candidates(q, k).items():
            _time_candidate(report, name, impl, (tq, tk, tv), causal, scale, needs_grad)
    timed = {n: t for n, t in report.items() if isinstance(t, float)}
    choice = min(timed, key=timed.get) if timed else "sdpa"
    report["chosen"] = choice
    report["sdpa_runs"] = sdpa_own_kernel(tq, tk, tv, causal, scale, needs_grad)
    _auto_choice[sig] = choice
    _auto_report[sig] = report
    logger.info(
        "attention backend for %s: %s (%s)",
        _describe(sig),
        choice,
        ", ".join(f"{n} {t:.3f} ms" for n, t in sorted(timed.items(), key=lambda kv: kv[1])),
    )
    return choice


def sdpa_own_kernel(q, k, v, causal: bool, scale: float | None, needs_grad: bool) -> str:
    """The kernel plain SDPA dispatches these inputs to, as auto's candidates name it ("cudnn",
    "flash", "efficient", "math"), or "unknown" where torch cannot say."""
    if SDPBackend is None or not hasattr(torch, "_fused_sdp_choice"):  # pragma: no cover - old torch
        return "unknown"
    try:
        args = [t.detach() for t in (q, k, v)]
        if torch.is_autocast_enabled(q.device.type):  # SDPA runs in the autocast dtype there
            args = [t.to(torch.get_autocast_dtype(q.device.type)) for t in args]
        args = [t.requires_grad_(needs_grad) for t in args]
        gqa = q.shape[1] != k.shape[1]
        picked = SDPBackend(torch._fused_sdp_choice(*args, None, 0.0, causal, scale=scale, enable_gqa=gqa))
    except Exception:  # a torch whose dispatch query differs: not known, never guessed
        return "unknown"
    return picked.name.removesuffix("_ATTENTION").lower()  # CUDNN_ATTENTION -> cudnn, MATH -> math


def same_kernel_as_sdpa(report: dict) -> bool:
    """Whether a measured signature's pick (``attention_autotune_report()`` entry) runs the kernel
    plain SDPA would have run itself: plain SDPA, or SDPA restricted to that very kernel."""
    chosen, runs = report.get("chosen"), report.get("sdpa_runs")
    return chosen == "sdpa" or (runs not in (None, "unknown") and chosen == f"sdpa_{runs}")


# --- timing a candidate: attention_timing.py -------------------------------------------------


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _measurable(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether auto chooses by measuring for these inputs (CUDA, no explicit mask), else plain SDPA."""
    return q.device.type == "cuda" and mask is None


def _auto_impl(q, k, v, causal, mask, scale) -> tuple[str, _Impl]:
    if not _measurable(q, mask):
        return "sdpa", _run_sdpa
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    dtype = str(q.dtype).removeprefix("torch.")
    if torch.compiler.is_compiling():
        # nothing can be measured in a trace: the family's usual pick, from the choices as they
        # were when the forward was traced (_measured_families); compared with the trace's head
        # counts and size, which the comparison fixes where they are symbolic
        for (f_dtype, hq, hkv, d, f_causal, f_grad), pick in _measured_families():
            if (f_dtype, f_causal, f_grad) == (dtype, bool(causal), needs_grad) and (
                hq == q.shape[1] and hkv == k.shape[1] and d == q.shape[3]
            ):
                return _pick(pick, q, k)
        return _pick(None, q, k)
    family = (dtype, q.shape[1], k.shape[1], q.shape[3], bool(causal), needs_grad)
    sig = (str(q.device), dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
           bool(causal), needs_grad)  # fmt: skip
    if _capturing(q.device):
        # nothing can be measured in a CUDA-graph capture: the exact shape's measured pick (an
        # eager-warmed step has one), else the family's
        return _pick(_auto_choice.get(sig) or _family_choice(family), q, k)
    choice = _auto_choice.get(sig)
    if choice is None:
        choice = _measure(sig, q, k, v, causal, scale, needs_grad)
    return choice, _candidates(q, k).get(choice, _run_sdpa)


def _pick(choice: str | None, q: torch.Tensor, k: torch.Tensor) -> tuple[str, _Impl]:
    """A compile's or a capture's pick, or plain SDPA (counted) where nothing was measured."""
    if choice is None:
        _count("auto->sdpa: signature not measured before compile/capture")
        return "sdpa", _run_sdpa
    return choice, _candidates(q, k).get(choice, _run_sdpa)


@torch.compiler.assume_constant_result
def _measured_families() -> tuple:
    """((dtype, heads, kv heads, head size, causal, grad), pick) for each family measured so far,
    its pick the backend measured most often at its batches and lengths. Under torch.compile this
    is taken once, when the forward is traced, and kept as a constant: read there as a dict, the
    measured choices became guards, and the first measurement after the trace (say, an eager
    evaluation's) recompiled the whole forward (about 14 s on an H100 at the 100M preset,
    packages/hydra-train/BENCHMARKS.md). It takes no arguments: a constant function's must be
    constants, and a trace's shapes may be symbolic."""
    families = {_family_of(sig) for sig in _auto_choice}
    return tuple((family, _family_choice(family)) for family in sorted(families, key=repr))


def _family_of(sig: tuple) -> tuple:
    """A measured signature's family: (dtype, heads, kv heads, head size, causal, grad)."""
    return sig[1], sig[3], sig[4], sig[7], sig[8], sig[9]


def _family_choice(family: tuple) -> str | None:
    """Under compile/capture (no measuring there): the backend measured most often for these
    heads and head size at any batch and length, or None if none was measured."""
    picks = [c for sig, c in _auto_choice.items() if _family_of(sig) == family]
    return Counter(picks).most_common(1)[0][0] if picks else None


def flexible_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, S, d] over k, v [B, Hkv, L, d] (Hq a multiple of Hkv) → [B, Hq, S, d].

    ``causal`` (alias ``is_causal``) masks keys after each query and needs S == L; ``attn_mask``
    (boolean, True = attend, broadcastable to [B, Hq, S, L]) is for decoding against a cache.
    ``scale`` defaults to 1/√d.
    """
    if is_causal is not None:
        causal = is_causal
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal attention needs as many queries as keys, got S={q.shape[2]}, L={k.shape[2]}"
        )
    if causal and attn_mask is not None:
        raise ValueError("pass either causal=True or attn_mask, not both")
    requested = OPTIONS.attention_backend
    if requested == "auto":
        name, impl = _auto_impl(q, k, v, causal, attn_mask, scale)
    elif requested == "sdpa":
        name, impl = "sdpa", _run_sdpa
    else:
        reason = _invalid_reason(requested, q, attn_mask)
        if reason is not None:
            _count(f"{requested}->sdpa: {reason}")
            name, impl = "sdpa", _run_sdpa
        else:
            name, impl = requested, (_run_flash if requested == "flash" else _run_xformers)
    if not torch.compiler.is_compiling():
        _log_once(requested, name, q)
    restricted = name != "sdpa" or OPTIONS.sdpa_flash_only or OPTIONS.sdpa_no_flash
    if torch.compiler.is_compiling() or not restricted:
        return impl(q, k, v, causal, attn_mask, scale)
    try:
        return impl(q, k, v, causal, attn_mask, scale)
    except RuntimeError as exc:  # e.g. a restricted SDPA kernel that rejects these inputs
        _count(f"{name}->sdpa (unrestricted): {type(exc).__name__}")
        return _run_sdpa(q, k, v, causal, attn_mask, scale, restrict="none")


_logged: set[tuple[str, str, str]] = set()


def _log_once(requested: str, used: str, q: torch.Tensor) -> None:
    key = (requested, used, q.device.type)
    if key not in _logged:
        _logged.add(key)
        sdpa_mode = (
            "flash only" if OPTIONS.sdpa_flash_only else "no flash" if OPTIONS.sdpa_no_flash else "any kernel"
        )
        logger.info(
            "attention backend: requested %s, using %s on %s (SDPA: %s)",
            requested,
            used,
            q.device.type,
            sdpa_mode,
        )
