"""Rotary position embedding, NeoX rotate-half, on the first R channels of each head.

Triton kernels: to be added (issue 3). Until then the public function runs the reference.
"""

import torch


def _broadcast_table(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [S, R/2] -> [1, S, 1, R/2]; [B, S, R/2] (per-sequence positions) -> [B, S, 1, R/2]
    return (t.unsqueeze(0) if t.dim() == 2 else t).unsqueeze(2).float()


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: ``x`` [B, S, H, D]; ``cos``/``sin`` [S, R/2] or [B, S, R/2] with even R ≤ D."""
    half = cos.shape[-1]
    rot = 2 * half
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
    c, s = _broadcast_table(cos, x), _broadcast_table(sin, x)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of every head of ``x``; the rest pass through."""
    return rope_ref(x, cos, sin)
