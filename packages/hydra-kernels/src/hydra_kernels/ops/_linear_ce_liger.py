"""Optional hand-off of ``linear_cross_entropy`` to Liger-Kernel (``HYDRA_ENABLE_LIGER_CE=1``).

Liger's ``LigerFusedLinearCrossEntropyFunction`` (0.8.5) covers the op's features: ignore_index,
mean/sum/none (none recomputes in backward), z-loss (its ``lse_square_scale`` is the same
``z·lse²`` per non-ignored token) and fp32 weight-gradient accumulation (``accum_dtype``, passed
unless the lean ``dw_accum="input"`` mode is on). What it lacks, and where hydra's own kernel
runs instead, each announced once by a warning:

- not importable: nothing to hand off to;
- tensors not on CUDA (Liger has no CPU path);
- ``hidden`` and ``weight`` of different dtypes outside autocast (Liger multiplies them as given);
- an installed version without ``accum_dtype`` while fp32 accumulation is asked for;
- ``reduction="none"`` with a Liger older than 0.8.5: earlier versions scaled the summed weight
  gradient by per-token gradients, which is wrong (0.8.5 recomputes instead);
- torch.compile: Liger's forward syncs with the host (``.item()``), a graph break, so the caller
  never hands off while compiling.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import warnings
from typing import Any

import torch

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"hydra_kernels: HYDRA_ENABLE_LIGER_CE is on, but {reason}; linear_cross_entropy runs "
            "hydra's own kernel for such calls.",
            RuntimeWarning,
            stacklevel=4,
        )


@functools.lru_cache(maxsize=1)
def _liger() -> tuple[Any, tuple[str, ...], tuple[int, ...]] | None:
    """(the autograd.Function, its forward's parameter names after ctx, version) or None."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:  # ImportError, or a broken install raising anything else
        return None
    names = tuple(inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters)[1:]
    try:
        raw = importlib.metadata.version("liger-kernel")
        version = tuple(int(p) for p in raw.split(".")[:3] if p.isdigit())
    except importlib.metadata.PackageNotFoundError:
        version = ()
    return LigerFusedLinearCrossEntropyFunction, names, version


def unsupported_reason(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    reduction: str,
    wants_fp32: bool,
    names: tuple[str, ...],
    version: tuple[int, ...],
) -> str | None:
    """Why Liger (with forward parameters ``names``, at ``version``) cannot take this call."""
    if hidden.device.type != "cuda":
        return "the tensors are not on CUDA"
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled("cuda"):
        return "hidden and weight have different dtypes outside autocast"
    if wants_fp32 and "accum_dtype" not in names:
        return "this Liger version has no accum_dtype (fp32 weight-gradient accumulation)"
    if reduction == "none" and version < (0, 8, 5):
        return "Liger before 0.8.5 gets the weight gradient of reduction='none' wrong"
    return None


def positional_args(forward: Any, given: dict[str, Any]) -> list[Any]:
    """``forward``'s arguments after ctx, in order: ``given`` values, defaults elsewhere, and the
    trailing defaults left out (``autograd.Function.apply`` takes no keywords)."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    args = [given.get(p.name, p.default) for p in params]
    while args and params[len(args) - 1].name not in given:
        args.pop()
    missing = [p.name for p in params[: len(args)] if p.name not in given and p.default is p.empty]
    if missing:
        raise TypeError(f"Liger's fused linear CE wants arguments hydra does not know: {missing}")
    return args


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    z_loss: float,
    dw_accum: str,
) -> torch.Tensor | None:
    """Liger's fused linear CE of ``hidden [N, D]``, or None (after a one-time warning) where
    Liger lacks something this call needs."""
    found = _liger()
    if found is None:
        _warn_once("liger_kernel is not importable")
        return None
    fn, names, version = found
    wants_fp32 = dw_accum != "input" and weight.dtype in (torch.float16, torch.bfloat16)
    reason = unsupported_reason(hidden, weight, reduction, wants_fp32, names, version)
    if reason:
        _warn_once(reason)
        return None
    given = {
        "_input": hidden,
        "weight": weight,
        "target": targets,
        "ignore_index": ignore_index,
        "lse_square_scale": float(z_loss),
        "reduction": reduction,
    }
    if wants_fp32:
        given["accum_dtype"] = torch.float32
    out = fn.apply(*positional_args(fn.forward, given))
    return out[0] if isinstance(out, tuple) else out
