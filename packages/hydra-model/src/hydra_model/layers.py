"""Shared layers: RMSNorm, SwiGLU MLP, the rotary table every attention layer shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import fused_add_rms_norm, rms_norm, swiglu
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


class SwiGLUMLP(nn.Module):
    """w_down(silu(x·W_gate) · x·W_up); gate and up come from one fused matmul."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [..., H] each
        return self.w_down(swiglu(gate, up))


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
            return
        exponents = torch.arange(half, device=device, dtype=torch.float64) * 2 / max(1, self.rotary_dim)
        inv_freq = self.base**-exponents  # [R/2]
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()

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
            return F.embedding(positions, self.cos), F.embedding(positions, self.sin)
        if seq_len is None:
            raise ValueError("tables() needs seq_len or positions")
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the rotary table ({self.max_seq_len}); "
                "raise max_seq_len in the config"
            )
        return self.cos[:seq_len], self.sin[:seq_len]
