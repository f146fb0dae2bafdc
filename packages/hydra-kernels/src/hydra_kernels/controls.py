"""Which implementation runs: Triton kernel or PyTorch reference, per op, with counted fallbacks.

Every public op asks :func:`triton_path` once per call. The answer is "Triton" when Triton
imported, kernels are switched on globally and for that op, and the tensors live where a Triton
kernel can run: on a CUDA device, or on the CPU while ``TRITON_INTERPRET=1`` (set before
``import triton``) makes Triton interpret kernels there. Anything else takes the reference.

A Triton kernel that raises at run time is not fatal: the op reruns on its reference, the failure
is counted per op (:func:`fallback_counts`, :func:`get_kernel_status`) and warned about once, so a
broken kernel is visible instead of silently slow.

The switches are fields of :data:`hydra_kernels.options.OPTIONS`; the ``set_*`` functions here set
them, and the environment fills them (read at import and by :func:`reload_env`), each op's switch
defaulting to on:

====================================  =====================================================
``HYDRA_DISABLE_TRITON=1``            every op uses its reference
``HYDRA_ENABLE_FUSED_<OP>=0`` or      that op's Triton forward (and backward) off; ``<OP>`` is
``HYDRA_DISABLE_FUSED_<OP>=1``        ``RMS_NORM``, ``SWIGLU``, ``QK_NORM``, ``ROPE``, ``LINEAR_CE`` (each
                                      op's ``env`` in hydra_kernels.registry)
``HYDRA_ENABLE_FUSED_<OP>_BWD=0`` or  only the fused backward off (``RMS_NORM``, ``SWIGLU``,
``HYDRA_DISABLE_FUSED_<OP>_BWD=1``    ``QK_NORM``): the forward stays fused, the backward is
                                      computed by PyTorch from the saved inputs
``HYDRA_ENABLE_LIGER_CE=1``           ``linear_cross_entropy`` uses Liger-Kernel's fused linear
                                      cross-entropy when it is importable (default off)
====================================  =====================================================
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hydra_kernels import launch_config
from hydra_kernels.options import OPTIONS, OpSwitch, env_flag, env_switch
from hydra_kernels.registry import OP_SPECS

#: The ops, in the order status tables list them (hydra_kernels.registry, one entry each).
OPS: tuple[str, ...] = tuple(spec.name for spec in OP_SPECS)

#: Generation, no-grad forward and optimizer-step kernels outside the registry (no ``hydra-kernels
#: check`` or bench entry: no autograd, tested in their own test modules): each has a switch
#: (HYDRA_DISABLE_<stem>) and its run-time failures are counted with the others'. op -> stem.
DECODE_OPS: dict[str, str] = {
    "router_decide": "ROUTER_DECIDE",
    "kv_decode_step": "KV_DECODE",
    "tile_linear": "TILE_LINEAR",
    "checksum": "CHECKSUM",  # generation's weight fingerprint (hydra_model/decoder_hold.py)
    "causal_select": "CAUSAL_SELECT",  # a whole sequence's routing selection (no-grad forwards)
    "router_logit": "ROUTER_LOGIT",  # a whole sequence's router logits (no-grad forwards)
    "gated_update": "GATED_UPDATE",  # a routed block's gated residual update (no-grad forwards)
    "ccgqa_prefill": "CCGQA_PREFILL",  # CCGQA's window, shifted values, a prefill's state (no-grad)
    "kv_prefill": "KV_PREFILL",  # a prefill's attention cache: keys, values, mask, lengths (generation)
    "ccgqa_window_tiles": "CCGQA_WINDOW_TILES",  # CCGQA's conv weights as a decode window's tiles
    "total_norm": "TOTAL_NORM",  # a gradient clip's total norm (hydra-train's step, no grad)
    "adamw": "ADAMW",  # AdamW's update over many tensors (hydra-train's step)
}

# op -> (environment stem of the forward switch, stem of the backward switch or None)
_ENV_STEMS: dict[str, tuple[str, str | None]] = {spec.name: (spec.env, spec.env_bwd) for spec in OP_SPECS}
_ENV_STEMS.update({op: (stem, None) for op, stem in DECODE_OPS.items()})


# --- Triton availability (decided once: importing triton is what makes it usable) ------------

try:  # pragma: no cover - depends on the machine
    import triton as _triton

    TRITON_AVAILABLE = True
    TRITON_VERSION: str | None = getattr(_triton, "__version__", None)
    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install that raises anything else
    TRITON_AVAILABLE = False
    TRITON_VERSION = None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

#: True when Triton interprets kernels on CPU tensors (``TRITON_INTERPRET=1`` before import).
INTERPRETER_ACTIVE: bool = TRITON_AVAILABLE and bool(env_flag("TRITON_INTERPRET"))


@dataclass
class _OpState:
    """What happened to an op's Triton kernels at run time (its switches are in OPTIONS.ops)."""

    fallbacks: int = 0
    warned: bool = False
    last_error: str | None = None


_lock = threading.Lock()
_states: dict[str, _OpState] = {op: _OpState() for op in (*OPS, *DECODE_OPS)}
OPTIONS.ops.update({op: OpSwitch() for op in (*OPS, *DECODE_OPS)})


def reload_env() -> None:
    """Re-read the ``HYDRA_*`` switches into :data:`hydra_kernels.options.OPTIONS` (fallback counts
    are kept)."""
    launch_config.reload_env()
    with _lock:
        OPTIONS.triton = not env_flag("HYDRA_DISABLE_TRITON")
        OPTIONS.liger_ce = bool(env_flag("HYDRA_ENABLE_LIGER_CE"))
        for op, (fwd_stem, bwd_stem) in _ENV_STEMS.items():
            sw = OPTIONS.ops[op]
            sw.forward = env_switch(fwd_stem)
            sw.backward = sw.forward and (env_switch(bwd_stem) if bwd_stem else True)


reload_env()


def _check_op(op: str) -> _OpState:
    try:
        return _states[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(_states)}") from None


def set_use_triton_kernels(enabled: bool) -> None:
    """Switch every Triton kernel on or off at once (per-op switches are kept underneath)."""
    OPTIONS.triton = bool(enabled)


def use_triton_kernels() -> bool:
    """Whether Triton kernels are switched on globally (and Triton imported)."""
    return OPTIONS.triton and TRITON_AVAILABLE


def set_op_enabled(op: str, enabled: bool, *, backward: bool | None = None) -> None:
    """Switch one op's Triton forward (and by default its backward) on or off."""
    _check_op(op)
    sw = OPTIONS.ops[op]
    sw.forward = bool(enabled)
    sw.backward = bool(enabled) if backward is None else bool(backward) and bool(enabled)


def use_liger_ce() -> bool:
    """Whether ``linear_cross_entropy`` should hand off to Liger-Kernel when it is importable."""
    return OPTIONS.liger_ce


def set_use_liger_ce(enabled: bool) -> None:
    OPTIONS.liger_ce = bool(enabled)


def device_supports_triton(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on the CPU only under the interpreter."""
    if not TRITON_AVAILABLE:
        return False
    if device.type == "cuda":
        return not INTERPRETER_ACTIVE  # the interpreter wants host memory
    return device.type == "cpu" and INTERPRETER_ACTIVE


def triton_path(op: str, *tensors: torch.Tensor, backward: bool = False) -> bool:
    """Whether ``op`` (its backward when ``backward``) should run its Triton kernel on ``tensors``."""
    sw = OPTIONS.ops.get(op)
    if sw is None:
        _check_op(op)
    if not (OPTIONS.triton and TRITON_AVAILABLE and (sw.backward if backward else sw.forward)):
        return False
    for t in tensors:  # device_supports_triton, unrolled: this runs on every call of every op
        if t.is_cuda:
            if INTERPRETER_ACTIVE:  # the interpreter wants host memory
                return False
        elif not (INTERPRETER_ACTIVE and t.device.type == "cpu"):
            return False
    return True


def record_fallback(op: str, exc: BaseException) -> None:
    """Count a run-time Triton failure of ``op`` and warn the first time it happens."""
    st = _check_op(op)
    with _lock:
        st.fallbacks += 1
        st.last_error = f"{type(exc).__name__}: {exc}"[:500]
        first = not st.warned
        st.warned = True
    if first:
        warnings.warn(
            f"hydra_kernels: the Triton {op} kernel failed ({st.last_error}); this call and any "
            f"later failing ones run the PyTorch reference instead. get_kernel_status() counts them.",
            RuntimeWarning,
            stacklevel=3,
        )


def fallback_counts() -> dict[str, int]:
    """Run-time Triton failures per op since import (or the last reset)."""
    return {op: st.fallbacks for op, st in _states.items()}


def reset_fallback_counts() -> None:
    with _lock:
        for st in _states.values():
            st.fallbacks, st.warned, st.last_error = 0, False, None


def _current_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def get_kernel_status() -> dict[str, Any]:
    """What runs where: Triton availability, switches, and per op the backend for this machine's
    default device (CUDA when present, else CPU) with its fallback count."""
    dev = _current_device()
    status: dict[str, Any] = {
        "triton_available": TRITON_AVAILABLE,
        "triton_version": TRITON_VERSION,
        "triton_import_error": TRITON_IMPORT_ERROR,
        "use_triton_kernels": use_triton_kernels(),
        "interpreter": INTERPRETER_ACTIVE,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(dev)))
        if dev.type == "cuda"
        else None,
        "liger_ce": OPTIONS.liger_ce,
        "ops": {},
    }
    from hydra_kernels.ops import _launch  # imports this module: not at the top

    status["fast_launch"] = {"enabled": _launch.FAST_LAUNCH, "error": _launch.fast_launch_error}
    runs_here = OPTIONS.triton and device_supports_triton(dev)
    for op, st in _states.items():
        sw = OPTIONS.ops[op]
        status["ops"][op] = {
            "enabled": sw.forward,
            "backward_enabled": sw.backward,
            "backend": "triton" if (runs_here and sw.forward) else "reference",
            "backward_backend": "triton" if (runs_here and sw.backward) else "reference",
            "fallbacks": st.fallbacks,
            "last_error": st.last_error,
        }
    return status
