"""Cross-entropy of ``hidden @ weight.T`` against targets without the full [N, V] logits.

Triton kernels and the chunked path: to be added (issue 3). Until then the public function runs the
reference, which DOES materialise the logits (it is the reference, not the op).
"""

import torch
import torch.nn.functional as F


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Reference: full logits in fp32; z-loss adds ``z_loss * logsumexp²`` per non-ignored token."""
    logits = (hidden @ weight.t()).float()
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    valid = targets != ignore_index
    if z_loss:
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss * lse.pow(2) * valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean (over non-ignored tokens), sum or per-token CE of ``hidden [N, D] @ weight [V, D].T``."""
    return linear_cross_entropy_ref(hidden, weight, targets, ignore_index, reduction, z_loss)
