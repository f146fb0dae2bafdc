"""Shared layers: RMSNorm, SwiGLU MLP, the rotary table every attention layer shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import fused_add_rms_norm, rms_norm, swiglu_packed
from hydra_kernels.controls import TRITON_AVAILABLE

#: Whether the hydra_kernels Triton kernels can run on this machine at all (Triton imported).
FUSED_KERNELS_AVAILABLE: bool = TRITON_AVAILABLE


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension on ``hydra_kernels.rms_norm`` (fp32 statistics)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x + residual)`` in one fused pass (the sum itself is not needed here)."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)[0]


def autocast_dtype_for(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run ``t``'s matmuls in (``t.dtype`` when autocast is off)."""
    if t.is_floating_point() and torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


class _SwiGLUDown(torch.autograd.Function):
    """``swiglu_packed(gate_up) @ w_downᵀ`` that keeps only ``gate_up`` for the backward and
    recomputes the [N, H] SwiGLU output there (one elementwise pass) for the weight gradient,
    instead of holding it from forward to backward: H·2 bytes less per token and application
    (8 KiB at the 100M preset's H = 4096, ~2 GiB of a B=8×2048 routed step)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        w = w_down.to(gate_up.dtype)  # what autocast does to the weight
        ctx.save_for_backward(gate_up, w)
        ctx.weight_dtype = w_down.dtype
        return F.linear(swiglu_packed(gate_up), w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, w = ctx.saved_tensors
        with torch.enable_grad():
            gu = gate_up.detach().requires_grad_(True)
            act = swiglu_packed(gu)  # [..., H], recomputed
        grad_out = grad_out.to(w.dtype)
        grad_act = grad_out @ w  # [..., H]
        flat_g, flat_a = grad_out.reshape(-1, w.shape[0]), act.detach().reshape(-1, w.shape[1])
        grad_w = (flat_g.t() @ flat_a).to(ctx.weight_dtype)  # [E, H]
        (grad_gate_up,) = torch.autograd.grad(act, gu, grad_act)
        return grad_gate_up, grad_w


class SwiGLUMLP(nn.Module):
    """w_down(silu(x·W_gate) · x·W_up); gate and up come from one fused matmul and stay packed
    (``swiglu_packed``: their gradient comes back as one [N, 2H] tensor, no slice copies). In
    eager training the SwiGLU output is recomputed in the backward instead of saved
    (:class:`_SwiGLUDown`); compiled code leaves that choice to the compiler's partitioner."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)  # [..., 2H]: gate | up
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and self.w_down.bias is None:
            return _SwiGLUDown.apply(gate_up, self.w_down.weight)
        return self.w_down(swiglu_packed(gate_up))


class RotaryEmbedding(nn.Module):
    """One cos/sin table [max_seq_len, rotary_dim/2] (fp32) shared by all attention layers.

    ``tables(n)`` gives the first n rows; ``tables(positions=p)`` with p [B, n] gathers rows per
    sequence, which is how routed (gathered) tokens keep their original positions.
    """

    def __init__(self, rotary_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even")
        self.rotary_dim = rotary_dim
        self.base = base
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # both side by side [max_seq_len, rotary_dim]: a gather at positions reads them in one launch
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self._build(max_seq_len)

    @property
    def max_seq_len(self) -> int:
        return int(self.cos.shape[0])

    def _build(self, length: int) -> None:
        half = self.rotary_dim // 2
        device = self.cos.device
        if device.type == "meta":
            self.cos = torch.empty(length, half, device=device)
            self.sin = torch.empty(length, half, device=device)
            self.cos_sin = torch.empty(length, 2 * half, device=device)
            return
        exponents = torch.arange(half, device=device, dtype=torch.float64) * 2 / max(1, self.rotary_dim)
        inv_freq = self.base**-exponents  # [R/2]
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()
        self.cos_sin = torch.cat([self.cos, self.sin], dim=-1)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round the fp32 table to bf16: rebuild it on the new device.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32 and self.cos.device.type != "meta":
            self._build(self.max_seq_len)
        return self

    def ensure(self, length: int) -> None:
        """Grow the table to hold ``length`` positions (called outside the hot path, e.g. generate)."""
        if length > self.max_seq_len:
            self._build(length)

    def tables(
        self, seq_len: int | None = None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin): [seq_len, R/2] for positions 0..seq_len−1, or [B, n, R/2] for ``positions``."""
        if positions is not None:
            half = self.cos.shape[1]
            if half % 4 or not half:  # sin's view would start off a 16-byte boundary (fast launches)
                return F.embedding(positions, self.cos), F.embedding(positions, self.sin)
            # views of one gather: the rope kernels take two tables of equal strides
            return F.embedding(positions, self.cos_sin).split(half, dim=-1)
        if seq_len is None:
            raise ValueError("tables() needs seq_len or positions")
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the rotary table ({self.max_seq_len}); "
                "raise max_seq_len in the config"
            )
        return self.cos[:seq_len], self.sin[:seq_len]
