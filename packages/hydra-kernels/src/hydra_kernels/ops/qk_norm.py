"""Per-head L2 normalisation of queries/keys (CCGQA): x · scale / ‖x‖₂ · exp(temperature[h]).

Triton kernels: to be added (issue 3). Until then the public function runs the reference.
"""

import torch

# Guards the division for an all-zero head; far below any real norm.
NORM_EPS = 1e-6


def qk_norm_ref(x: torch.Tensor, scale: float, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``x`` is [..., H, D]; fp32 norms; ``temperature`` is [H] or None."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(NORM_EPS * NORM_EPS))
    y = xf * inv * scale
    if temperature is not None:
        y = y * temperature.float().exp().unsqueeze(-1)
    return y.to(x.dtype)


def qk_norm(x: torch.Tensor, scale: float, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """``x / ‖x‖₂ * scale`` per head over the last dim, times ``exp(temperature[h])`` if given."""
    return qk_norm_ref(x, scale, temperature)
