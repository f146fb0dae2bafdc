"""linear_cross_entropy's PyTorch reference (full logits) and the elementwise gradient tolerances
its checks allow for the op's own roundings (:func:`grad_rounding_atol`).

Separate from ``ops/linear_cross_entropy.py`` (which re-exports both) because neither runs in the
op: they materialise [N, V] (and O(N·V·D) fp64 work for the tolerances), for the tests,
``hydra-kernels check`` and the bench scripts.
"""

from __future__ import annotations

import math

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
    """Reference: full logits, CE in fp32 (fp64 for fp64 inputs); z-loss adds
    ``z_loss * logsumexp²`` per non-ignored token. Materialises [N, V]: for tests only.

    Takes what :func:`linear_cross_entropy` takes: ``hidden [..., D]`` with ``targets [...]`` of
    any integer dtype, and a weight of another float dtype (cast to hidden's: the matmul runs in
    hidden's dtype, as the op's do); ``"none"`` returns targets' shape."""
    # flattened: F.cross_entropy reads a [B, S, V] input's dim 1 as the classes
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).long()  # cross_entropy takes int64 (or uint8) class indices only
    logits = h2 @ weight.to(h2.dtype).t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="none")
    valid = y != ignore_index
    if z_loss:
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss * lse.pow(2) * valid
    if reduction == "none":
        return loss.reshape(targets.shape)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def grad_rounding_atol(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    grad_out: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise tolerances ``(atol_dh [N, D], atol_dW [V, D])`` (fp64) to add to the
    fp32-noise atol when checking this op's gradients in ``dtype`` against torch's.

    Like torch, the op rounds the logits' gradient G to ``dtype`` before the two GEMMs, but its
    fp32 softmax is not bit-identical to torch's (another summation order, another exp): now and
    then an element of G sitting on a rounding midpoint rounds to the other neighbour (about 2e-5
    of the elements on the CPU in bf16). That moves ``dW[v, d]`` before its own rounding by
    δ ≤ ``eps(dtype)·max_n |G[n, v]·h[n, d]|`` (dh likewise with W), and that can tip the final
    rounding of ``dW[v, d]`` to the other neighbour as well. With torch's error t, the op's is then
    at most ``t + δ + ulp(dW[v, d])`` ≤ ``2t + δ + eps·|dW[v, d]|``: the allowance returned is
    ``δ_max + eps·|ref|``, one such flip per output element. Several, or anything of the size of
    a real bug, still fail. In fp32 all of this is 2⁻²³-relative.

    A scalar ``grad_out`` that is not a power of two (mean/sum) changes the picture: the op
    computed G during the forward, before the gradient was known, and rounds G rather than
    ``grad_out·G``, so its roundings of G are unrelated to torch's. Both start from the same
    rounded logits, so ``|op − ref64| ≤ |op − torch| + |torch − ref64|`` and ``|op − torch|`` is at
    most the sum of the two computations' own rounding errors after the logits: for dW
    ``eps/2·(Σ_n |G[n, v]·h[n, d]| + |dW|)`` each (G rounded, the GEMM output rounded once); for
    dh ``eps/2·(Σ_v |G[n, v]·W[v, d]| + 2·|dh|)`` for the op (GEMM output and scaling rounded) and
    the same with ``|dh|`` once for torch. That sum is the allowance: rigorous but ~√N looser, so
    the check is then only that the op is within its own error analysis. (Counting the op's
    roundings alone is not enough: torch's error against fp64 mixes the logits' rounding with its
    own rounding of G, and where the two cancel, ``2·|torch − ref64|`` does not cover torch's
    share of ``|op − torch|``; on the H100 that failed ``hydra-kernels check`` at ratio 1.15.)
    Pass ``grad_out=1`` (or a power of two) to check at full strictness.

    Nor are the rounded logits always torch's: a logits GEMM of another shape may sum a logit's
    products in another order. On an H100 the default mode's logits, padded to 64 columns at
    V = 5003, were one ulp away from torch's unpadded ``h @ W.T`` in about 6e-5 of the bf16
    elements, and ``bench_linear_ce.py``'s check failed for about one seed in seven
    (packages/hydra-kernels/BENCHMARKS.md). A logit x[n, v] one ulp (δ) off scales its own entry
    of G's softmax part (weight·p, times 1 + 2z·(|lse| + 1) with z-loss) by exp(±δ), a move m[n, v];
    through the softmax's normalisation it also moves every other entry u of row n by about
    p[n, u]·m[n, v], which matters in a confident row (p near 1). Counting one such logit per
    output element, as for G, and at most one per row for the normalisation, which reaches every
    column: dW[u, d] adds the largest over n of m[n, u]·|h[n, d]| plus the sum over n of
    p[n, u]·max_v m[n, v]·|h[n, d]|; dh[n, d] the largest over v of m[n, v]·|W[v, d]| plus
    max_v m[n, v]·Σ_u p[n, u]·|W[u, d]|. That term grows with |logit|: with logits up to about 3
    a dW rounded to bf16 after each of 19 chunks still fails, and three confident rows (a logit
    of 7) with that logit one ulp off pass (tests/hydra_kernels/test_linear_cross_entropy.py);
    with logits of 6 or more the check no longer tells a per-chunk bf16 dW apart.
    Costs O(N·V·D) work in fp64: for test and check shapes.
    """
    h = hidden.detach().reshape(-1, hidden.shape[-1]).to(dtype).double()
    w = weight.detach().to(dtype).double()
    y = targets.reshape(-1)
    x = (h @ w.t()).requires_grad_()  # [N, V]
    loss = F.cross_entropy(x, y, ignore_index=ignore_index, reduction="none")
    valid = y != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, dim=-1).pow(2) * valid
    g = torch.ones((), dtype=loss.dtype) if grad_out is None else torch.as_tensor(grad_out, dtype=loss.dtype)
    g = g.to(loss.device)
    weights = (
        g.reshape(-1) if reduction == "none" else g / (valid.sum().clamp_min(1) if reduction == "mean" else 1)
    )
    (loss * weights).sum().backward()
    g_abs = x.grad.abs()
    eps = torch.finfo(dtype).eps
    # a logit one ulp off (another summation order in the logits GEMM) moves its own entry of G
    # (the softmax part scales by exp(±ulp)) and, through the softmax's sum, every other entry u
    # of its row by p_u times that move; one such logit per output element, as for G's own flip
    x0 = x.detach()
    p = torch.softmax(x0, dim=-1)
    scale = (weights * valid).reshape(-1, 1).abs()
    if z_loss:  # the z-loss part 2z·lse·p and its own derivative through lse
        scale = scale * (1 + 2 * z_loss * (torch.logsumexp(x0, dim=-1, keepdim=True).abs() + 1))
    ulp = eps * torch.ldexp(torch.ones_like(x0), torch.frexp(x0)[1] - 1)
    own = scale * p * torch.expm1(ulp)  # [N, V]
    renorm = own.amax(dim=-1, keepdim=True)  # [N, 1]: the row's largest such move
    flip_dh = _largest_over_v(own, w) + renorm * (p @ w.abs())
    # the normalisation reaches every column, so each row with such a logit adds to all of dW
    flip_dw = _largest_over_n(own, h) + (p * renorm).t() @ h.abs()
    if reduction != "none" and math.frexp(float(g))[0] not in (0.0, 0.5, -0.5):
        # the op's and torch's roundings of G, then the final roundings: the op's dh twice (GEMM
        # output, scaled) and torch's once; dW once in each
        atol_dh = eps / 2 * (2 * (g_abs @ w.abs()) + 3 * (x.grad @ w).abs())
        return atol_dh + flip_dh, eps * (g_abs.t() @ h.abs() + (x.grad.t() @ h).abs()) + flip_dw
    atol_dh = eps * (_largest_over_v(g_abs, w) + (x.grad @ w).abs()) + flip_dh
    return atol_dh, eps * (_largest_over_n(g_abs, h) + (x.grad.t() @ h).abs()) + flip_dw


def _largest_over_v(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """For non-negative per-logit sizes a [N, V]: [N, D], the max over v of a[n, v]·|W[v, d]|,
    without an [N, V, D] temporary."""
    w_abs = w.abs()
    return torch.stack([(a[n, :, None] * w_abs).amax(0) for n in range(a.shape[0])])


def _largest_over_n(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """For non-negative per-logit sizes a [N, V]: [V, D], the max over n of a[n, v]·|h[n, d]|."""
    largest = torch.zeros(a.shape[1], h.shape[1], dtype=a.dtype, device=a.device)
    h_abs = h.abs()
    for n in range(a.shape[0]):
        torch.maximum(largest, a[n, :, None] * h_abs[n][None, :], out=largest)
    return largest
