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
``momentum``, committed between steps (so a step routes with one τ; see RouterThreshold);
evaluation and decoding read it unchanged. The router itself
learns from the LM loss through the gate σ(logit) that scales the routed update.

Capacities are fixed-point fractions (``CAPACITY_ONE`` = 2²⁰) so the budget is integer arithmetic:
the host's gather size and the device's budget can never disagree by a rounding.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch import nn

from hydra_model.cache import put_count

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
    the membership mask [B, k] (True on the taken prefix). At most k tokens per row are taken.

    Each token's place in that order is known from a running count, so the order is a scatter,
    not a sort: a taken token goes after the taken ones before it, an untaken one after every
    taken token and the untaken ones before it (what hydra_kernels' causal_select computes). The
    top-k sort this replaces took two kernels, about 60 µs a routing point, in the 100M preset's
    compiled step on an H100 (packages/hydra-model/BENCHMARKS.md)."""
    b, n = taken.shape
    t = torch.arange(n, device=taken.device).expand(b, n)
    took = taken.long()
    running = took.cumsum(-1)
    ahead, total = running - took, running[:, -1:]  # taken before t; taken in all
    dest = torch.where(taken, ahead, total + t - ahead)  # [B, n]: a permutation of 0..n−1
    idx = torch.empty_like(dest).scatter_(1, dest, t)[:, :k]
    member = torch.arange(k, device=taken.device).unsqueeze(0) < total
    return idx, member


#: grid points on which a training step counts how many candidate logits lie above (see below)
GRID_POINTS = 65
#: the grid spans τ ± GRID_HALF_WIDTH · spread (spread: a running standard deviation of logits)
GRID_HALF_WIDTH = 4.0


def _grid(tau: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """τ + spread · (GRID_POINTS steps over ±GRID_HALF_WIDTH), broadcast along the last dim."""
    steps = torch.linspace(-GRID_HALF_WIDTH, GRID_HALF_WIDTH, GRID_POINTS, device=tau.device)
    return tau + spread * steps


def _fresh_when_absent(module, state_dict, prefix, *args) -> None:
    """A state dict saved without this threshold (a model built with static routing before static
    models kept their thresholds) loads it fresh: τ is taken from the first commit (seen = 0)."""
    for name in ("tau", "spread", "seen"):
        state_dict.setdefault(prefix + name, getattr(module, name).detach().clone())


class RouterThreshold(nn.Module):
    """The threshold τ of one routing point: a running estimate of the (1 − target) quantile of
    its logits over the candidate tokens.

    A training forward *records* additive statistics: on a fixed grid of GRID_POINTS values
    around τ, how many candidates lie above each, plus the candidates' count, sum and sum of
    squares. Being sums, records of micro-batches (or of DDP ranks, all-reduced) add up to the
    record of the whole batch exactly. A *commit* reads the quantile off the grid (linear
    interpolation between the two points the target share falls between), folds it into τ as an
    EMA with ``momentum`` (taken as it is at the first commit; when it falls off the grid, τ
    re-centres on the normal approximation mean + z·std and the spread is reset) and updates the
    spread. The model commits at the start of the next
    training forward by default (like BatchNorm, this works in any loop); a trainer that owns
    its step commits after each optimizer step instead (``threshold_commit = "manual"``),
    passing whether the step was applied, so that a skipped step leaves τ as it was. τ is
    constant within a step: gradient checkpointing's recomputation routes as the forward did; it
    records the same sums a second time, which scales the record without changing its ratios."""

    def __init__(self, target: float, momentum: float) -> None:
        super().__init__()
        self.target = float(target)
        self.momentum = float(momentum)
        #: the standard normal's (1 − target) quantile: the re-centring guess is mean + z · std
        self.z = statistics.NormalDist().inv_cdf(min(max(1.0 - self.target, 1e-6), 1 - 1e-6))
        self.register_buffer("tau", torch.zeros(()))
        self.register_buffer("spread", torch.ones(()))
        #: 0 until the first commit
        self.register_buffer("seen", torch.zeros(()))
        # the record lives from a forward to the next commit: not part of a checkpoint
        self.register_buffer("above", torch.zeros(GRID_POINTS), persistent=False)
        self.register_buffer("moments", torch.zeros(3), persistent=False)  # count, sum, sum of squares
        self.register_load_state_dict_pre_hook(_fresh_when_absent)

    def extra_repr(self) -> str:
        return f"target={self.target:g}, momentum={self.momentum:g}"

    def grid(self) -> torch.Tensor:
        """The GRID_POINTS values [K] this step's record counts against."""
        return _grid(self.tau, self.spread)

    @torch.no_grad()
    def record(self, logit: torch.Tensor, candidates: torch.Tensor | None) -> None:
        """Add this forward's statistics of ``logit`` [B, n] over ``candidates`` (all when None)
        to the record. Non-finite logits are left out. No host sync."""
        x = logit.detach().float().reshape(-1)
        keep = torch.isfinite(x)
        if candidates is not None:
            keep = keep & candidates.reshape(-1)
        w = keep.float()
        x = torch.where(keep, x, torch.zeros_like(x))
        above = ((x.unsqueeze(0) > self.grid().unsqueeze(1)).float() * w).sum(dim=1)  # [K]
        self.above.add_(above)
        self.moments.add_(torch.stack([w.sum(), (x * w).sum(), (x * x * w).sum()]))

    @torch.no_grad()
    def commit(self, applied: torch.Tensor | None = None) -> None:
        """Fold the record into τ and the spread and clear it; with ``applied`` False (a bool
        tensor: the optimizer step did not go through) only clear it. No host sync. A model
        commits all its thresholds together (:func:`commit_thresholds`)."""
        commit_thresholds([self], applied)

    def passes(self, logit: torch.Tensor) -> torch.Tensor:
        return logit > self.tau


def commit_thresholds(thresholds: list[RouterThreshold], applied: torch.Tensor | None = None) -> None:
    """Commit every threshold of ``thresholds`` (see :meth:`RouterThreshold.commit`), those that
    share a device, target and momentum as one batch: their buffers stacked, the same elementwise
    ops run once on [R, ...] rows, the results copied back in one multi-tensor launch. A commit
    is ~55 tiny kernels whatever R is: one routing point at a time, the 100M preset's five took
    285 launches a training step. Each row is computed exactly as it would be alone."""
    groups: dict[tuple, list[RouterThreshold]] = {}
    for t in thresholds:
        groups.setdefault((t.tau.device, t.tau.dtype, t.target, t.momentum), []).append(t)
    for group in groups.values():
        _commit_group(group, applied)


@torch.no_grad()
def _commit_group(group: list[RouterThreshold], applied: torch.Tensor | None) -> None:
    first = group[0]
    target, momentum, z = first.target, first.momentum, first.z
    state = torch.stack([x for t in group for x in (t.tau, t.spread, t.seen)]).view(-1, 3)  # [R, 3]
    tau, spread, seen = state.unbind(-1)  # [R] each
    above = torch.stack([t.above for t in group])  # [R, K]
    count, total, squares = torch.stack([t.moments for t in group]).unbind(-1)  # [R] each
    ready = count > 0
    if applied is not None:
        ready = ready & applied.to(device=ready.device, dtype=torch.bool)
    safe = count.clamp(min=1.0)
    frac = above / safe.unsqueeze(1)  # [R, K], non-increasing along each row's grid
    grid = _grid(tau.unsqueeze(1), spread.unsqueeze(1))  # [R, K]: each row's RouterThreshold.grid()
    # i: grid points whose share above exceeds the target; the quantile lies after the i-th
    i = (frac > target).sum(-1)  # [R]
    # gathered with an index tensor, never indexed by a 0-d tensor: that calls __index__, a host
    # read that breaks a compiled graph (and kept the race's forward out of CUDA graphs)
    pick = torch.stack([(i - 1).clamp(0, GRID_POINTS - 1), i.clamp(0, GRID_POINTS - 1)], dim=-1)  # [R, 2]
    f_lo, f_hi = frac.gather(1, pick).unbind(-1)
    g_lo, g_hi = grid.gather(1, pick).unbind(-1)
    step = torch.where(f_lo > f_hi, (f_lo - target) / (f_lo - f_hi).clamp(min=1e-12), 0.0)
    quantile = g_lo + step.clamp(0, 1) * (g_hi - g_lo)
    mean = total / safe
    std = (squares / safe - mean * mean).clamp(min=0).sqrt().clamp(min=1e-3)
    # off the grid, the grid says only "beyond this end": re-centre on a normal approximation
    # of the quantile and take the spread as it is, so the next grid covers the logits
    off_grid = (i == 0) | (i == GRID_POINTS)
    quantile = torch.where(off_grid, mean + z * std, quantile)
    take = (seen == 0) | off_grid
    blended = torch.where(take, quantile, momentum * tau + (1 - momentum) * quantile)
    new_spread = torch.where(take, std, momentum * spread + (1 - momentum) * std)
    committed = torch.stack([blended, new_spread, torch.ones_like(seen)], -1)  # [R, 3]
    new = torch.where(ready.unsqueeze(1), committed, state)
    buffers = [x for t in group for x in (t.tau, t.spread, t.seen)]
    torch._foreach_copy_(buffers, list(new.view(-1).unbind(0)))  # one launch for every row
    torch._foreach_zero_([x for t in group for x in (t.above, t.moments)])


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
            if self.key in counts:
                prev.add_(taken.long())  # in place: a captured decode step replays on it
            else:
                counts[self.key] = prev + taken.long()
            return taken.unsqueeze(1)
        taken = causal_take(passed, budget)
        if counts is not None:
            put_count(counts, self.key, taken.long().sum(dim=1))
        return taken
