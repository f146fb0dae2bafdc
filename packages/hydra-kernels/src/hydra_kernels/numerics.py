"""The project's numerical acceptance criterion for a kernel against references.

A kernel output passes when, elementwise,

    |kernel − ref64| ≤ 2 · |torch_same_dtype − ref64| + atol

where ``ref64`` is the PyTorch reference run in float64 and ``torch_same_dtype`` is the same
reference run in the kernel's input dtype. The kernel may be up to twice as wrong as PyTorch
itself is at that precision; ``atol`` only absorbs noise where PyTorch happens to be (nearly)
exact: it should be a few fp32 ulps of the output's scale (:func:`fp32_noise_atol`), far below a
single bf16/fp16 ulp, so that any real error still fails.

``reduction="max"`` compares the largest errors instead (max|kernel − ref64| ≤
2·max|torch − ref64| + atol). Use it where the op itself rounds an intermediate to the low
precision (e.g. ``x + residual`` stored in bf16 and then normalised): kernel and PyTorch then
share that rounding's error, PyTorch's further roundings cancel it at a few elements by chance,
and an elementwise ratio would measure that luck rather than the kernel.

Used by the tests and by ``hydra-kernels check``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NumericsCheck:
    """Result of :func:`check_against_fp64`. ``worst_ratio`` is the largest
    ``|kernel − ref64| / (2·|torch − ref64| + atol)`` over all elements: ≤ 1 passes."""

    passed: bool
    worst_ratio: float
    kernel_max_err: float
    torch_max_err: float
    atol: float

    def __bool__(self) -> bool:
        return self.passed

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{verdict}: worst ratio {self.worst_ratio:.3g} (≤ 1 passes), max |kernel−ref64| "
            f"{self.kernel_max_err:.3g}, max |torch−ref64| {self.torch_max_err:.3g}, atol {self.atol:.3g}"
        )


def fp32_noise_atol(ref64: torch.Tensor, ulps: float = 16.0) -> float:
    """``ulps`` fp32 ulps of ``ref64``'s largest magnitude: the size of reordering noise in fp32
    arithmetic at that scale (reductions in another order, an approximate rsqrt), ~500× below
    one bf16 ulp."""
    scale = float(ref64.detach().abs().max()) if ref64.numel() else 0.0
    return ulps * torch.finfo(torch.float32).eps * max(scale, torch.finfo(torch.float32).tiny)


def check_against_fp64(
    kernel_out: torch.Tensor,
    same_dtype_out: torch.Tensor,
    ref64: torch.Tensor,
    atol: float,
    reduction: str = "elementwise",
) -> NumericsCheck:
    """Apply the criterion, ``"elementwise"`` (default) or on the ``"max"`` errors. Shapes must
    match; ``atol`` must be positive. A NaN or infinity in the kernel's output where the fp64
    reference is finite fails."""
    if not atol > 0:
        raise ValueError(f"atol must be positive, got {atol}")
    if reduction not in ("elementwise", "max"):
        raise ValueError(f"reduction must be 'elementwise' or 'max', got {reduction!r}")
    if kernel_out.shape != ref64.shape or same_dtype_out.shape != ref64.shape:
        raise ValueError(
            f"shape mismatch: kernel {tuple(kernel_out.shape)}, torch {tuple(same_dtype_out.shape)}, "
            f"fp64 reference {tuple(ref64.shape)}"
        )
    ref = ref64.detach().to(device="cpu", dtype=torch.float64)
    k_err = (kernel_out.detach().to(device="cpu", dtype=torch.float64) - ref).abs()
    t_err = (same_dtype_out.detach().to(device="cpu", dtype=torch.float64) - ref).abs()
    if k_err.numel() == 0:
        return NumericsCheck(True, 0.0, 0.0, 0.0, atol)
    # A non-finite kernel value against a finite reference is an infinite error.
    k_err = torch.where(torch.isfinite(k_err) | ~torch.isfinite(ref), k_err, torch.inf)
    k_err = torch.nan_to_num(k_err, nan=0.0)  # NaN only where the reference itself is NaN/inf
    t_err = torch.nan_to_num(t_err, nan=torch.inf, posinf=torch.inf)
    if reduction == "max":
        worst = float(k_err.max() / (2.0 * t_err.max() + atol))
    else:
        worst = float((k_err / (2.0 * t_err + atol)).max())
    return NumericsCheck(
        passed=worst <= 1.0,
        worst_ratio=worst,
        kernel_max_err=float(k_err.max()),
        torch_max_err=float(t_err.max()),
        atol=atol,
    )
