"""hydra_kernels: fused Triton kernels (forward and backward) with PyTorch references.

Each op picks its Triton kernel on CUDA tensors (or on CPU tensors under ``TRITON_INTERPRET=1``)
and its PyTorch reference otherwise; see :mod:`hydra_kernels.controls`. Every process-wide switch
is a field of ``kernel_options`` (:mod:`hydra_kernels.options`).
"""

__version__ = "0.1.0"

import importlib

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
from hydra_kernels.modules import HydraLinearCrossEntropyLoss, HydraRMSNorm, HydraSwiGLUMLP
from hydra_kernels.options import OPTIONS as kernel_options
from hydra_kernels.options import KernelOptions
from hydra_kernels.patching import PatchRecord, Replacement, patch, patch_fallback_counts
from hydra_kernels.registry import OP_SPECS

# every registered op's public functions (hydra_kernels.registry: an op's ``exports``)
_OP_EXPORTS: list[str] = []
for _spec in OP_SPECS:
    _module = importlib.import_module(_spec.module)
    for _name in _spec.exports:
        globals()[_name] = getattr(_module, _name)
        _OP_EXPORTS.append(_name)

__all__ = [
    "OPS",
    "HydraLinearCrossEntropyLoss",
    "HydraRMSNorm",
    "HydraSwiGLUMLP",
    "KernelOptions",
    "PatchRecord",
    "Replacement",
    "__version__",
    "benchmark_kernels",
    "fallback_counts",
    "get_kernel_status",
    "kernel_options",
    "patch",
    "patch_fallback_counts",
    "print_benchmark_results",
    "reload_env",
    "reset_fallback_counts",
    "set_op_enabled",
    "set_use_triton_kernels",
    "use_triton_kernels",
    *_OP_EXPORTS,
]
