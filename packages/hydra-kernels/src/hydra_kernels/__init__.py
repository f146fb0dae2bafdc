"""hydra_kernels: fused Triton kernels (forward and backward) with PyTorch references.

Each op picks its Triton kernel on CUDA tensors (or on CPU tensors under ``TRITON_INTERPRET=1``)
and its PyTorch reference otherwise; see :mod:`hydra_kernels.controls`. Every process-wide switch
is a field of ``kernel_options`` (:mod:`hydra_kernels.options`).
"""

__version__ = "0.1.0"

from hydra_kernels.bench import benchmark_kernels, print_benchmark_results
from hydra_kernels.controls import (
    OPS,
    fallback_counts,
    get_kernel_status,
    reload_env,
    reset_fallback_counts,
    set_op_enabled,
    set_use_triton_kernels,
    use_triton_kernels,
)
from hydra_kernels.modules import HydraLinearCrossEntropyLoss, HydraRMSNorm, HydraSwiGLUMLP, patch
from hydra_kernels.ops.linear_cross_entropy import (
    LinearCEOptions,
    linear_ce_options,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    reset_linear_ce_options,
    set_linear_ce_options,
)
from hydra_kernels.ops.qk_norm import qk_norm, qk_norm_ref
from hydra_kernels.ops.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from hydra_kernels.ops.rope import rope, rope_ref
from hydra_kernels.ops.swiglu import swiglu, swiglu_packed, swiglu_ref
from hydra_kernels.options import OPTIONS as kernel_options
from hydra_kernels.options import KernelOptions

__all__ = [
    "OPS",
    "HydraLinearCrossEntropyLoss",
    "HydraRMSNorm",
    "HydraSwiGLUMLP",
    "KernelOptions",
    "LinearCEOptions",
    "__version__",
    "benchmark_kernels",
    "fallback_counts",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "get_kernel_status",
    "kernel_options",
    "linear_ce_options",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "patch",
    "print_benchmark_results",
    "qk_norm",
    "qk_norm_ref",
    "reload_env",
    "reset_fallback_counts",
    "reset_linear_ce_options",
    "rms_norm",
    "rms_norm_ref",
    "rope",
    "rope_ref",
    "set_linear_ce_options",
    "set_op_enabled",
    "set_use_triton_kernels",
    "swiglu",
    "swiglu_packed",
    "swiglu_ref",
    "use_triton_kernels",
]
