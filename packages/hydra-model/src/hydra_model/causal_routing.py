"""Causal capacity routing: the token-selection rule MoD and MoR use in training, evaluation and
decoding alike, so the model trained is the model evaluated.

A routing point with capacity c takes token t when

1. its router logit clears the routing point's threshold τ (a tracked quantile, below), and
2. fewer than ``budget(t) = ⌈c · (t + 1)⌉`` tokens at positions ≤ t are already taken
   (first come, first served; t is the token's position in the original sequence).

Both conditions look at tokens ≤ t only, so the output at t never depends on later tokens, and
at most ⌈c · S⌉ tokens of a length-S sequence are taken: the routed block runs on a fixed
[B, ⌈c · S⌉, E] gather, as top-k expert choice does, with the unused rows masked. The budget grows
with the position rather than being one number per sequence so that a prefix routes the same
whether or not the rest of the sequence exists: a full forward and incremental decoding agree.

The count of taken tokens follows ``C(t) = min(C(t−1) + p(t), b(t))`` (p: passed the threshold,
b: the budget). Unrolled, ``C(t) = S(t) + min(0, min_{u ≤ t} (b(u) − S(u)))`` with S the inclusive
cumulative sum of p: a cumsum and a cummin, no loop, no host sync. Token t is taken where C grows.

The threshold τ is a buffer: training (gradients on) moves it towards the (1 − target) quantile
of each batch's router logits over the candidate tokens, an exponential moving average with
``momentum``, committed at the start of the next training step (so a step routes with one τ);
evaluation and decoding read it unchanged. The router itself
learns from the LM loss through the gate σ(logit) that scales the routed update.

Capacities are fixed-point fractions (``CAPACITY_ONE`` = 2²⁰) so the budget is integer arithmetic:
the host's gather size and the device's budget can never disagree by a rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

CAPACITY_BITS = 20
CAPACITY_ONE = 1 << CAPACITY_BITS


def capacity_fixed(capacity: float) -> int:
    """``capacity`` in (0, 1] as a fixed-point integer out of CAPACITY_ONE (at least 1)."""
    if not 0 < capacity <= 1:
        raise ValueError(f"capacity {capacity} must be in (0, 1]")
    return max(1, round(capacity * CAPACITY_ONE))


def budget_count(cap_q: int, length: int) -> int:
    """Most tokens a routing point of fixed-point capacity ``cap_q`` takes among ``length``
    positions: ⌈cap · length⌉, exactly as :func:`position_budget` computes it on the device."""
    return (length * cap_q + CAPACITY_ONE - 1) >> CAPACITY_BITS


def position_budget(pos: torch.Tensor, cap_q: int) -> torch.Tensor:
    """``budget(t) = ⌈cap · (pos + 1)⌉`` for positions pos [B, n] (long) → [B, n] long."""
    return ((pos + 1) * cap_q + (CAPACITY_ONE - 1)) >> CAPACITY_BITS


def causal_take(passed: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Which tokens are taken [B, n] bool, given which ``passed`` the threshold [B, n] bool and
    each row's budget [B, n] long (non-decreasing along a row where ``passed``; see the module
    docstring for the recurrence and its closed form)."""
    p = passed.long()
    s = p.cumsum(-1)  # S(t), inclusive
    budget = budget.cummax(-1).values  # rows after the last candidate may carry smaller positions
    slack = (budget - s).cummin(-1).values.clamp(max=0)
    count = s + slack  # C(t)
    return count > F.pad(count[:, :-1], (1, 0))


def take_first_k(taken: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [B, k] of the taken tokens in time order followed by untaken ones (padding), and
    the membership mask [B, k] (True on the taken prefix). At most k tokens per row are taken."""
    n = taken.shape[1]
    t = torch.arange(n, device=taken.device)
    key = torch.where(taken, t, t + n)  # distinct keys: taken first, both parts in time order
    idx = key.topk(k, dim=-1, largest=False, sorted=True).indices if k < n else key.argsort(dim=-1)
    member = torch.arange(k, device=taken.device).unsqueeze(0) < taken.sum(dim=1, keepdim=True)
    return idx, member


class RouterThreshold(nn.Module):
    """The threshold τ of one routing point: the running (1 − target) quantile of its logits.

    A training forward only *records* its batch quantile; the next training forward *commits*
    it into τ before routing anything (:meth:`commit`, called by the model outside any
    checkpointed region). So τ is constant within a step: gradient checkpointing's recomputation
    routes exactly as the forward did, and re-recording the same value is harmless."""

    def __init__(self, target: float, momentum: float) -> None:
        super().__init__()
        self.target = float(target)
        self.momentum = float(momentum)
        self.register_buffer("tau", torch.zeros(()))
        #: 0 until the first commit (which then takes the recorded quantile as it is)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("pending", torch.zeros(()))
        self.register_buffer("has_pending", torch.zeros(()))

    def extra_repr(self) -> str:
        return f"target={self.target:g}, momentum={self.momentum:g}"

    @torch.no_grad()
    def record(self, logit: torch.Tensor, candidates: torch.Tensor | None) -> None:
        """Remember the value of ``logit`` [B, n] above which a ``target`` share of the
        ``candidates`` (all when None) lies. No host sync."""
        flat = logit.detach().float().reshape(-1)
        if candidates is None:
            count = torch.full((), flat.numel(), device=flat.device, dtype=torch.long)
            ranked = flat.sort(descending=True).values
        else:
            cand = candidates.reshape(-1)
            count = cand.sum()
            ranked = flat.masked_fill(~cand, -math.inf).sort(descending=True).values
        # ranked[j] with j = ⌊target · count⌋: exactly j candidates lie above it (ties aside)
        j = (count.float() * self.target).floor().long().clamp(max=flat.numel() - 1)
        j = torch.minimum(j, (count - 1).clamp(min=0))
        self.pending.copy_(ranked.gather(0, j.view(1)).squeeze(0))
        self.has_pending.copy_((count > 0).to(self.has_pending.dtype))

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the recorded quantile into τ (an EMA; the first one is taken as it is)."""
        blended = torch.where(
            self.seen > 0, self.momentum * self.tau + (1 - self.momentum) * self.pending, self.pending
        )
        ready = self.has_pending > 0
        self.tau.copy_(torch.where(ready, blended, self.tau))
        self.seen.copy_(torch.maximum(self.seen, self.has_pending))
        self.has_pending.zero_()

    def passes(self, logit: torch.Tensor) -> torch.Tensor:
        return logit > self.tau


class CausalRouter(nn.Module):
    """One routing point's causal decision: its threshold, its fixed-point capacity (relative to
    the whole sequence) and its key in a decoding cache's counters."""

    def __init__(self, capacity: float, target: float, momentum: float, key: tuple[int, int]) -> None:
        super().__init__()
        self.cap_q = capacity_fixed(capacity)
        self.key = key
        self.threshold = RouterThreshold(target, momentum)

    def extra_repr(self) -> str:
        return f"capacity={self.cap_q / CAPACITY_ONE:.6g}, key={self.key}"

    def rows(self, n: int, seq_len: int) -> int:
        """Gather size for an n-row (sub-)sequence of a length-``seq_len`` sequence."""
        return min(n, budget_count(self.cap_q, seq_len))

    def decide(
        self,
        logit: torch.Tensor,
        pos: torch.Tensor,
        candidates: torch.Tensor | None,
        counts: dict | None = None,
        decoding: bool = False,
    ) -> torch.Tensor:
        """Taken tokens [B, n] bool for router logits [B, n] at positions pos [B, n]. Training
        (gradients on, module in training mode) records the batch quantile for the threshold's
        next commit (:class:`RouterThreshold`). ``counts``: a
        decoding cache's counters (per key: [B] tokens taken so far), read when ``decoding`` one
        token and written in both cases."""
        if self.training and torch.is_grad_enabled():
            self.threshold.record(logit, candidates)
        passed = self.threshold.passes(logit)
        if candidates is not None:
            passed = passed & candidates
        budget = position_budget(pos, self.cap_q)
        if decoding:
            prev = counts.get(self.key)
            if prev is None:
                prev = torch.zeros(logit.shape[0], dtype=torch.long, device=logit.device)
            taken = passed[:, 0] & (prev < budget[:, 0])
            counts[self.key] = prev + taken.long()
            return taken.unsqueeze(1)
        taken = causal_take(passed, budget)
        if counts is not None:
            counts[self.key] = taken.long().sum(dim=1)
        return taken
