"""SwiGLU activation: silu(gate) · up.

Triton kernels: to be added (issue 3). Until then the public function runs the reference.
"""

import torch
import torch.nn.functional as F


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference: silu computed in fp32, result in the inputs' dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise; gate and up have the same shape."""
    return swiglu_ref(gate, up)
