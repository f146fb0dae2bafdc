"""Fixed-shape token routing primitives shared by MoD and MoR.

Two ways to run a block on a subset of a sequence, both without host syncs:

* **gather** (training, expert choice): the top k = ⌈capacity · n⌉ tokens by router score, k a
  Python int, indices sorted so the sub-sequence keeps time order; the block runs on [B, k, E].
* **selected-first permutation** (eval threshold routing, token choice, decoding): a stable sort
  puts the selected tokens first, in time order, and the block runs on the whole permuted
  [B, n, E]. A causal block never lets the selected prefix see the unselected tail, so the
  prefix outputs are exactly those of the selected sub-sequence alone; only they are scattered
  back (``member`` marks them). The count per sequence is data-dependent, the shapes are not.

In both, tokens keep their original positions for RoPE (positions are gathered alongside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def flat_index(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Row indices [B·m] into a [B·n, ...] flattening of per-sequence indices idx [B, m]."""
    b = idx.shape[0]
    return (idx + torch.arange(b, device=idx.device).unsqueeze(1) * n).reshape(-1)


def _gather_rows_setup(ctx, inputs: tuple, output) -> None:
    """What the gather's backward keeps: the indices and the source's row count."""
    src, index = inputs
    ctx.save_for_backward(index)
    ctx.n_rows = src.shape[0]


class _GatherRows(torch.autograd.Function):
    """``src[index]`` along dim 0 for DISTINCT indices. The backward writes each gradient row to
    its one source row (``index_copy``) instead of ``index_select``'s generic ``index_add``:
    no atomics, deterministic, and the same cost in any dtype (bf16 atomics are slow)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        _gather_rows_setup(ctx, (src, index), None)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.n_rows, *grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


# Under torch.compile the same gather is a custom op with the same setup and backward: an
# autograd.Function traced into a graph makes torch skip its AOTAutograd cache for the whole
# compiled model (a warm compile traced the joint graph again, packages/hydra-train/BENCHMARKS.md),
# a custom op does not.
@torch.library.custom_op("hydra_model::gather_rows", mutates_args=())
def _gather_rows_op(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.index_select(0, index)


@_gather_rows_op.register_fake
def _(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.new_empty((index.shape[0], *src.shape[1:]))


_gather_rows_op.register_autograd(_GatherRows.backward, setup_context=_gather_rows_setup)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``src[index]`` of src [N, ...] for distinct indices [M] → [M, ...] (see _GatherRows)."""
    if torch.compiler.is_compiling():
        return _gather_rows_op(src, index)
    return _GatherRows.apply(src, index)


def gather_tokens(h: torch.Tensor, idx: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """h [B, n, E], idx [B, m] (distinct per sequence) → h[b, idx[b, j]] as [B, m, E]. ``flat``:
    ``flat_index(idx, n)`` when the caller already has it."""
    b, n, e = h.shape
    flat = flat_index(idx, n) if flat is None else flat
    return gather_rows(h.reshape(b * n, e), flat).view(b, idx.shape[1], e)


def scatter_add_tokens(
    h: torch.Tensor, idx: torch.Tensor, update: torch.Tensor, flat: torch.Tensor | None = None
) -> torch.Tensor:
    """h with ``update`` [B, m, E] added at rows idx [B, m] (distinct per sequence); out of place.
    (``index_add``'s own backward is already atomic-free: the update's gradient is a gather.)"""
    b, n, e = h.shape
    flat = flat_index(idx, n) if flat is None else flat
    out = h.reshape(b * n, e).index_add(0, flat, update.reshape(-1, e).to(h.dtype))
    return out.view(b, n, e)


def topk_in_time_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k largest scores per row, sorted ascending (time order)."""
    return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def selected_first(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation [B, n] putting selected tokens first (time order kept in both parts), and the
    membership mask [B, n] of the permuted sequence (True on the selected prefix)."""
    n = selected.shape[1]
    t = torch.arange(n, device=selected.device)
    key = torch.where(selected, t, t + n)  # distinct keys: the sort is deterministic
    perm = key.argsort(dim=-1)
    member = t.unsqueeze(0) < selected.sum(dim=1, keepdim=True)
    return perm, member


def positions_or_arange(pos: torch.Tensor | None, batch: int, n: int, device: torch.device) -> torch.Tensor:
    if pos is not None:
        return pos
    return torch.arange(n, device=device).unsqueeze(0).expand(batch, n)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, count: int | None = None) -> torch.Tensor:
    """Mean of x over the True entries of ``mask`` (all when None). ``count``: the number of True
    entries when the caller knows it (expert choice: k per sequence), saving a reduction."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    total = (x * m).sum()
    return total / count if count is not None else total / m.sum().clamp_min(1.0)


def masked_mean_last(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per-channel mean of x [..., K] over the positions where ``mask`` [...] is True → [K]."""
    flat = x.reshape(-1, x.shape[-1])
    if mask is None:
        return flat.mean(0)
    m = mask.reshape(-1, 1).to(x.dtype)
    return (flat * m).sum(0) / m.sum().clamp_min(1.0)


def membership_bce(
    logits: torch.Tensor, target: torch.Tensor, candidates: torch.Tensor | None, count: int | None = None
) -> torch.Tensor:
    """Mean BCE of router logits against top-k membership over the candidate tokens (``count`` of
    them when known)."""
    if candidates is None:
        return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype))
    loss = F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")
    return masked_mean(loss, candidates, count)


@dataclass
class SubSequence:
    """A routed view of a sequence: which rows (``idx``), their positions, which are real."""

    idx: torch.Tensor  # [B, m] indices into the parent sequence
    pos: torch.Tensor  # [B, m] original positions
    member: torch.Tensor | None  # [B, m] bool, None when every gathered row is selected
    flat: torch.Tensor  # [B·m] idx as rows of the parent flattened to [B·n, ...]

    @classmethod
    def top_k(cls, scores: torch.Tensor, k: int, pos: torch.Tensor) -> SubSequence:
        idx = topk_in_time_order(scores, k)
        return cls(idx, pos.gather(1, idx), None, flat_index(idx, scores.shape[1]))

    @classmethod
    def permuted(cls, selected: torch.Tensor, pos: torch.Tensor) -> SubSequence:
        perm, member = selected_first(selected)
        return cls(perm, pos.gather(1, perm), member, flat_index(perm, selected.shape[1]))

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        return gather_tokens(h, self.idx, self.flat)

    def gather_values(self, t: torch.Tensor) -> torch.Tensor:
        """Per-token values t [B, n] (e.g. router gates) for the rows of this view."""
        return t.gather(1, self.idx)

    def scatter_add(self, h: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Add ``update`` [B, m, E] back to h, only for member rows."""
        if self.member is not None:  # where(), not a product: the tail is never mixed in
            update = torch.where(self.member.unsqueeze(-1), update, torch.zeros_like(update))
        return scatter_add_tokens(h, self.idx, update, self.flat)
