"""FP8 matmuls for the model's linear layers (``--experimental_fp8``, ``--fp8_format``, ``--fp8_scaling``).

Forward: the activation rows and the weight rows are quantised to FP8 (activations E4M3 by
default, E5M2 with ``--fp8_format e5m2``; weights always E4M3) with one fp32 scale per row
(``--fp8_scaling row``: per token and per output channel) or one per tensor (``tensor``),
``scale = amax / fp8_max`` so the largest magnitude maps to the format's largest finite value
(the quantiser is compiled on CUDA, one fused pass); ``torch._scaled_mm`` multiplies them on the
FP8 tensor cores and writes bf16. The master weights stay in their own dtype (fp32 under bf16
autocast) and are quantised afresh at every call, so the optimizer never sees FP8.

Backward, the decision: **bf16**. The gradients ``dX = dY·W`` and ``dW = dYᵀ·X`` are computed
from the bf16 input saved by the forward and the weight cast to bf16, i.e. exactly what an
autocast ``nn.Linear`` computes; this is the straight-through estimator of the quantisation.
FP8 gradients (E5M2) would need a transposed re-quantisation of dY, X and W per call; with bf16
the backward costs what it cost before and the gradients carry no FP8 error of their own: the
only FP8 error is in the forward activations.

Which layers: every plain ``nn.Linear`` whose two widths are multiples of 16 (the FP8 GEMM's
alignment rule). Routers (1 or R outputs) stay in bf16, and so does the tied LM head (a
functional matmul with the embedding, where rounding the logits would cost the most).

Swap and revert: the module's class is switched in place (``nn.Linear`` <-> :class:`Fp8Linear`),
so parameters, their optimizer state and state-dict keys never change, and ``deactivate`` leaves
exactly the modules that were there.

Off CUDA (tests) the scaled matmul is emulated: dequantised operands multiplied in fp32. The
quantisation itself is the same code on both devices.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hydra_train.safe_opts.registry import Optimization
from hydra_train.safe_opts.toggles import compile_options

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer

#: format -> (torch dtype, largest finite value, unit roundoff 2^-(mantissa bits + 1))
FP8_FORMATS: dict[str, tuple[torch.dtype, float, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0, 2.0**-4),
    "e5m2": (torch.float8_e5m2, 57344.0, 2.0**-3),
}
#: weights are always E4M3: their range is small and known, so precision matters more than range;
#: E5M2 x E5M2 is not a valid FP8 GEMM either, so ``--fp8_format`` chooses the activations' format
WEIGHT_FORMAT = "e4m3"
ALIGN = 16
_TINY = 1e-12  # scale floor: an all-zero row quantises to zeros instead of dividing by 0


def quantize(x: torch.Tensor, fmt: str, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (q [M, K] in FP8, scale fp32 [M, 1] or 0-d) with x ≈ q·scale."""
    dtype, fmax, _ = FP8_FORMATS[fmt]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    scale = amax.clamp_min(_TINY) / fmax
    q = (xf / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


_fused: dict[str, Any] = {"fn": None, "failed": None, "calls": 0}


def quantize_fused(x: torch.Tensor, fmt: str, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`, on CUDA through ``torch.compile`` (amax, scale, divide, clamp and cast fused
    into one or two passes instead of five). A compile that fails is reported once and the eager
    maths runs from then on (same result); inside an outer compile the plain function is traced."""
    if not x.is_cuda or torch.compiler.is_compiling() or _fused["failed"] is not None:
        return quantize(x, fmt, rowwise)
    if _fused["fn"] is None:
        _fused["fn"] = torch.compile(quantize, dynamic=True, options=compile_options("inductor"))
    try:
        out = _fused["fn"](x, fmt, rowwise)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        _fused["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        warnings.warn(
            f"fp8: compiling the quantiser failed ({_fused['failed']}); running it op by op", stacklevel=2
        )
        return quantize(x, fmt, rowwise)
    _fused["calls"] += 1
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def scaled_matmul(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(xq·sx) @ (wq·sw)ᵀ for xq [M, K], wq [N, K] → [M, N] in ``out_dtype``."""
    if not xq.is_cuda:  # emulation off CUDA: the same product from the dequantised operands
        return (dequantize(xq, sx) @ dequantize(wq, sw).t()).to(out_dtype)
    m = xq.shape[0]
    pad = (-m) % ALIGN  # the FP8 GEMM wants every width a multiple of 16; pad token rows with 0
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        if sx.dim():
            sx = torch.cat([sx, sx.new_ones(pad, 1)])
    sb = sw.reshape(1, -1) if sw.dim() else sw
    # mat2 must be column-major: wq is [N, K] row-major, so its transpose view is
    out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sb, out_dtype=out_dtype, use_fast_accum=True)
    return out[:m] if pad else out


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
        xq, sx = quantize_fused(x2d, fmt, rowwise)
        wq, sw = quantize_fused(weight, WEIGHT_FORMAT, rowwise)
        ctx.save_for_backward(x2d, weight)
        return scaled_matmul(xq, sx, wq, sw, torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        g = grad_out.to(torch.bfloat16)
        w = weight.to(torch.bfloat16)
        dx = g @ w  # [M, K]
        dw = g.t() @ x2d.to(torch.bfloat16)  # [N, K]
        return dx.to(x2d.dtype), dw.to(weight.dtype), None, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward runs the FP8 GEMM (installed by class swap, see above)."""

    fp8_format: str = "e4m3"
    fp8_rowwise: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
        out = _Fp8LinearFn.apply(x2d, self.weight, self.fp8_format, self.fp8_rowwise)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features)


def fp8_eligible(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.in_features % ALIGN == 0 and m.out_features % ALIGN == 0


def swap_to_fp8(model: nn.Module, fmt: str, rowwise: bool) -> list[str]:
    """Switch every eligible linear to FP8 in place; returns their names."""
    names = []
    for name, m in model.named_modules():
        if fp8_eligible(m):
            m.__class__ = Fp8Linear
            m.fp8_format, m.fp8_rowwise = fmt, rowwise
            names.append(name)
    return names


def revert_fp8(model: nn.Module) -> int:
    """Every :class:`Fp8Linear` back to ``nn.Linear``; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is Fp8Linear:
            m.__class__ = nn.Linear
            for attr in ("fp8_format", "fp8_rowwise"):
                m.__dict__.pop(attr, None)
            n += 1
    return n


class Fp8Matmuls(Optimization):
    name = "fp8"
    flag = "--experimental_fp8"
    title = "FP8 GEMMs in the forward of the model's linear layers (bf16 backward, bf16 master weights)"
    numerics = "fp8"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.swapped: list[str] = []

    def requested(self) -> bool:
        return self.cfg.optimizations.experimental_fp8

    def not_applicable(self, trainer: Trainer) -> str | None:
        if trainer.device.type != "cuda":
            return "needs a CUDA GPU with FP8 tensor cores (sm_89+); this run is on the CPU"
        cap = torch.cuda.get_device_capability(trainer.device)
        if cap < (8, 9):
            return f"needs FP8 tensor cores (sm_89+); this GPU is sm_{cap[0]}{cap[1]}"
        if not hasattr(torch, "_scaled_mm"):
            return "this torch has no torch._scaled_mm"
        if trainer.cfg.runtime.precision != "bf16":
            return "needs bf16 autocast (--precision bf16)"
        if not any(fp8_eligible(m) for m in trainer.model.modules()):
            return "no linear layer with both widths a multiple of 16"
        return None

    def activate(self, trainer: Trainer) -> None:
        self.swapped = swap_to_fp8(
            trainer.model, self.cfg.optimizations.fp8_format, self.cfg.optimizations.fp8_scaling == "row"
        )
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        revert_fp8(trainer.model)
        self.active = False

    def describe(self) -> dict[str, Any]:
        return {
            "format": self.cfg.optimizations.fp8_format,
            "scaling": self.cfg.optimizations.fp8_scaling,
            "backward": "bf16",
            "layers": len(self.swapped),
            "quantiser": "compiled" if _fused["failed"] is None else f"eager ({_fused['failed']})",
        }
