"""Causal capacity routing: the selection rule against a token-by-token reference, the tracked
threshold against a hand computation, and the model-level promises: the training forward is
causal, evaluation routes exactly as training does, and the compute stays within the budget."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from hydra_model import ModelCache, routing_stats_to_python
from hydra_model.causal_routing import (
    CAPACITY_ONE,
    RouterThreshold,
    budget_count,
    capacity_fixed,
    causal_take,
    commit_thresholds,
    position_budget,
    take_first_k,
)

from .conftest import random_tokens, small_model


def _take_loop(passed: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """First come, first served, one token at a time: the definition causal_take must match."""
    out = torch.zeros_like(passed)
    for b in range(passed.shape[0]):
        count = 0
        for t in range(passed.shape[1]):
            if passed[b, t] and count < budget[b, t]:
                out[b, t] = True
                count += 1
    return out


@pytest.mark.parametrize("capacity", [0.125, 0.3, 0.5, 0.75, 1.0])
def test_causal_take_equals_the_sequential_rule(capacity):
    g = torch.Generator().manual_seed(int(capacity * 1000))
    cap_q = capacity_fixed(capacity)
    for rate in (0.1, 0.5, 0.9):
        passed = torch.rand(4, 37, generator=g) < rate
        pos = torch.arange(37).expand(4, 37)
        budget = position_budget(pos, cap_q)
        got = causal_take(passed, budget)
        assert torch.equal(got, _take_loop(passed, budget))
        assert (got.sum(1) <= budget_count(cap_q, 37)).all()


def test_causal_take_on_a_gathered_subsequence_uses_original_positions():
    """Rows of a sub-sequence carry their original positions; the padding tail (after the
    candidates) may carry smaller ones and must not disturb anything."""
    pos = torch.tensor([[0, 3, 4, 9, 10, 1, 2]])
    passed = torch.tensor([[True, True, True, True, True, False, False]])
    budget = position_budget(pos, capacity_fixed(0.25))  # ⌈(p+1)/4⌉: 1, 1, 2, 3, 3, 1, 1
    got = causal_take(passed, budget)
    assert got.tolist() == [[True, False, True, True, False, False, False]]


def test_budget_is_exact_integer_ceiling():
    for capacity in (0.1, 0.3, 1 / 3, 0.7, 1.0):
        cap_q = capacity_fixed(capacity)
        exact = Fraction(cap_q, CAPACITY_ONE)
        for n in range(1, 300, 7):
            assert budget_count(cap_q, n) == math.ceil(exact * n)
            assert position_budget(torch.tensor([[n - 1]]), cap_q).item() == budget_count(cap_q, n)


def test_take_first_k_lists_taken_rows_first_in_time_order():
    taken = torch.tensor([[False, True, False, True, False, False], [True, False, False, False, False, True]])
    idx, member = take_first_k(taken, 3)
    assert idx.tolist() == [[1, 3, 0], [0, 5, 1]]
    assert member.tolist() == [[True, True, False], [True, True, False]]


def _grid_quantile(values: list[float], grid: list[float], target: float) -> float:
    """Independent reference: the share of values above each grid point, and the point where
    that share crosses ``target`` by linear interpolation (clamped to the grid's ends)."""
    frac = [sum(v > g for v in values) / len(values) for g in grid]
    if frac[0] <= target:
        return grid[0]
    for k in range(1, len(grid)):
        if frac[k] <= target:
            f_lo, f_hi = frac[k - 1], frac[k]
            return grid[k - 1] + (f_lo - target) / (f_lo - f_hi) * (grid[k] - grid[k - 1])
    return grid[-1]


def test_threshold_commit_reads_the_quantile_off_the_grid_and_blends_an_ema():
    thr = RouterThreshold(target=0.25, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    logit = torch.randn(3, 40, generator=g) * 0.7 + 0.2
    cand = torch.rand(3, 40, generator=g) < 0.6
    grid = thr.grid().tolist()
    thr.record(logit, cand)
    assert thr.tau.item() == 0  # recorded, not yet used
    values = logit[cand].tolist()
    first = _grid_quantile(values, grid, 0.25)
    thr.commit()
    assert thr.tau.item() == pytest.approx(first, abs=1e-5)
    exact = sorted(values, reverse=True)[math.floor(0.25 * len(values))]
    assert abs(first - exact) <= grid[1] - grid[0]  # within one grid step of the order statistic
    std = torch.tensor(values).std(unbiased=False).item()
    assert thr.spread.item() == pytest.approx(std, rel=1e-4)
    # second step: the grid has re-centred; the new quantile is blended in
    logit2 = torch.randn(2, 50, generator=g) * 0.7 + 0.2
    grid2 = thr.grid().tolist()
    second = _grid_quantile(logit2.reshape(-1).tolist(), grid2, 0.25)
    thr.record(logit2, None)
    thr.commit()
    assert thr.tau.item() == pytest.approx(0.9 * first + 0.1 * second, abs=1e-5)


def test_threshold_commit_reads_nothing_back_to_the_host():
    """The commit runs inside the race's compiled, CUDA-graphed forward: a host read in it (as
    indexing by a 0-d tensor was: ``aten._local_scalar_dense``) kept that part out of the graphs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    thr = RouterThreshold(0.25, 0.9)
    for step in range(3):
        thr.record(torch.randn(3, 40) * (1 + step), None)
        with Ops() as ops:
            thr.commit()
        assert ops.seen and not any("_local_scalar_dense" in op or "item" in op for op in ops.seen)


def test_threshold_commit_compiles_without_graph_breaks():
    """The commit traces as one graph and equals eager."""
    import torch._dynamo

    torch.manual_seed(3)
    eager, compiled = RouterThreshold(0.25, 0.9), RouterThreshold(0.25, 0.9)
    for step in range(4):
        logits = torch.randn(3, 40) * (1 + step)
        for thr in (eager, compiled):
            thr.record(logits, None)
        eager.commit()
        torch._dynamo.reset()
        torch.compile(compiled.commit, backend="aot_eager", fullgraph=True)()
        for name in ("tau", "spread", "seen"):
            torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=1e-6, atol=1e-6)
    assert eager.seen.item() == 1


def test_threshold_records_add_up_and_a_rejected_step_changes_nothing():
    g = torch.Generator().manual_seed(4)
    logit = torch.randn(4, 30, generator=g)
    whole, halves = RouterThreshold(0.5, 0.9), RouterThreshold(0.5, 0.9)
    whole.record(logit, None)
    halves.record(logit[:2], None)  # micro-batches of one step (or ranks, all-reduced)
    halves.record(logit[2:], None)
    whole.commit()
    halves.commit()
    assert torch.equal(whole.tau, halves.tau) and torch.allclose(whole.spread, halves.spread)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    whole.record(logit * 3 + 1, None)
    whole.commit(torch.tensor(False))
    for k, v in whole.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert whole.moments.sum() == 0  # the record was dropped


def test_threshold_recentres_when_the_quantile_falls_off_the_grid():
    thr = RouterThreshold(0.5, 0.99)
    thr.record(torch.zeros(1, 8), None)
    thr.commit()
    far = torch.linspace(20, 30, 64).view(1, -1)  # far above the grid τ ± 4·spread
    thr.record(far, None)
    thr.commit()
    # re-centred on mean + z·std (z = 0 at target ½), the spread reset to the data's: the next
    # grid covers the logits and reads the quantile off it again
    assert thr.tau.item() == pytest.approx(25.0, abs=1e-4)
    assert thr.spread.item() == pytest.approx(far.std(unbiased=False).item(), rel=1e-4)
    thr.record(far, None)
    thr.commit()
    exact = far.median().item()
    assert abs(thr.tau.item() - exact) < 0.5


def test_thresholds_committed_together_equal_each_committed_alone():
    """A model commits its thresholds in batches (those sharing target and momentum stacked):
    every threshold ends bit for bit where committing it alone leaves it, through first commits,
    EMA blends, a quantile off the grid, an empty record and a rejected step."""
    specs = [(0.25, 0.9), (0.25, 0.9), (0.5, 0.9), (0.25, 0.99), (0.25, 0.9), (0.125, 0.9)]
    together = [RouterThreshold(*spec) for spec in specs]
    alone = [RouterThreshold(*spec) for spec in specs]
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for step, applied in enumerate([None, torch.tensor(True), torch.tensor(False), None, None]):
        for k, (a, b) in enumerate(zip(together, alone, strict=True)):
            if step == 1 and k == 4:
                continue  # nothing recorded: the commit leaves it as it is
            scale = 40.0 if (step == 3 and k == 0) else 1.0  # far off the grid: re-centres
            logit = (torch.randn(2, 37, generator=g) * (1 + k) + k) * scale
            cand = torch.rand(2, 37, generator=g) < 0.7
            a.record(logit, cand)
            b.record(logit, cand)
        commit_thresholds(together, applied)
        for b in alone:
            b.commit(applied)
        for a, b in zip(together, alone, strict=True):
            for name in ("tau", "spread", "seen", "above", "moments"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
    assert all(t.seen.item() == 1 for t in together)


def test_a_threshold_commit_launches_as_many_kernels_for_five_as_for_one():
    from hydra_kernels.launch_count import KernelCount

    def launches(n: int) -> int:
        thresholds = [RouterThreshold(0.125, 0.9) for _ in range(n)]
        for t in thresholds:
            t.record(torch.randn(2, 16), None)
        with KernelCount() as count:
            commit_thresholds(thresholds, torch.tensor(True))
        return sum(count.kernels.values())

    assert launches(5) == launches(1) < 60  # one at a time, five took 285


def _mixed_model(**overrides):
    """A model whose routers really mix (some tokens in, some out) after a few training steps."""
    model = small_model(mod_capacity=0.5, **overrides).train()
    x, y = random_tokens(2, 31, seed=5), random_tokens(2, 31, seed=6)
    for _ in range(3):  # let the thresholds track their quantiles
        model(x, targets=y).loss.backward()
    return model


@pytest.mark.parametrize("recursions", [3, 1])
def test_training_forward_is_causal_and_routing_mixes(recursions):
    """Also with one recursion per block (MoD only, no MoR router: the 100M preset's layout)."""
    model = _mixed_model(recursions_per_block=recursions)
    x = random_tokens(2, 29, seed=11)
    with torch.no_grad():
        ref = model(x).logits
        stats = routing_stats_to_python(model.routing_stats())
        for t in (0, 9, 20):
            x2 = x.clone()
            x2[:, t + 1 :] = random_tokens(2, 28 - t, seed=200 + t)
            got = model(x2).logits
            torch.testing.assert_close(got[:, : t + 1], ref[:, : t + 1], atol=1e-5, rtol=0)
    assert 0 < stats["mod"][0]["selected_frac"] < 1
    if recursions > 1:
        assert any(1 < s["avg_depth"] < 3 for s in stats["mor"])
    else:
        assert stats["mor"] == [] and not any(
            "router" in n for n, _ in model.blocks[0].mor.named_parameters()
        )


def test_training_forward_with_gradients_is_causal_too():
    """The recorded quantile sees the whole batch but is used only from the next step on."""
    model = _mixed_model()
    # the two forwards must route with the same τ: with commits at the start of each forward the
    # second would fold in the first's record (not in the state dict), so commit by hand, once
    model.commit_router_thresholds()
    model.threshold_commit = "manual"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = random_tokens(1, 29, seed=12)
    ref = model(x).logits.detach()
    model.load_state_dict(state)
    x2 = x.clone()
    x2[:, 15:] = random_tokens(1, 14, seed=13)
    got = model(x2).logits.detach()
    torch.testing.assert_close(got[:, :15], ref[:, :15], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides", [{}, {"moe_enabled": True, "moe_num_experts": 3}, {"recursions_per_block": 1}]
)
def test_eval_routes_exactly_as_training(overrides):
    model = _mixed_model(**overrides)
    x, y = random_tokens(3, 31, seed=21), random_tokens(3, 31, seed=22)
    with torch.no_grad():
        train_out = model.train()(x, targets=y)
        eval_out = model.eval()(x, targets=y)
    torch.testing.assert_close(eval_out.ce_loss, train_out.ce_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(eval_out.logits, train_out.logits, atol=1e-5, rtol=0)


def test_thresholds_track_the_capacity():
    """After training steps the share of tokens MoD takes approaches its capacity."""
    model = small_model(mod_capacity=0.5, router_threshold_momentum=0.5).train()
    x, y = random_tokens(4, 48, seed=31), random_tokens(4, 48, seed=32)
    for _ in range(8):
        model(x, targets=y).loss.backward()
    frac = routing_stats_to_python(model.routing_stats())["mod"][0]["selected_frac"]
    assert 0.3 < frac <= 0.5 + 1e-6


def test_decoding_skips_what_the_token_is_routed_out_of(monkeypatch):
    """At batch 1 a decode step runs a MoD block only when its token is taken: fewer block calls
    than blocks × recursions, and the tokens generated equal the full forward's (see
    test_generation for the general equality)."""
    model = _mixed_model().eval()
    from hydra_model.blocks import CCGQABlock

    calls = []
    real = CCGQABlock.forward

    def counting(self, h, *a, **k):
        calls.append(h.shape[1])
        return real(self, h, *a, **k)

    monkeypatch.setattr(CCGQABlock, "forward", counting)
    prompt = random_tokens(1, 9, seed=41)
    out = model.generate(prompt, max_new_tokens=12)
    decode_calls = [c for c in calls if c == 1]
    full = model.config.n_mor_blocks * model.config.recursions_per_block * 11  # steps after the first
    assert len(decode_calls) < full
    monkeypatch.setattr(CCGQABlock, "forward", real)
    with torch.no_grad():
        seq = prompt
        for _ in range(12):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_decode_counts_follow_the_budget():
    model = _mixed_model().eval()
    cache = ModelCache(capacity=40)
    x = random_tokens(1, 20, seed=51)
    with torch.no_grad():
        model(x[:, :10], cache=cache)
        for t in range(10, 20):
            model(x[:, t : t + 1], cache=cache)
        full_counts = {}
        ref = ModelCache(capacity=40)
        model(x, cache=ref)
        full_counts = {k: v.clone() for k, v in ref.counts.items()}
    assert set(cache.counts) == set(full_counts)
    for key, value in cache.counts.items():
        assert torch.equal(value, full_counts[key]), key


def test_a_state_dict_without_thresholds_loads_them_fresh():
    """Models built with static routing did not keep causal thresholds before; their state dicts
    still load (strictly), the thresholds start fresh (taken from the first commit)."""
    model = small_model(static_routing_mode=True, mod_capacity=0.5)
    saved = {k: v for k, v in model.state_dict().items() if ".threshold." not in k}
    assert len(saved) < len(model.state_dict())  # the model has thresholds to fill
    for thr in model.router_thresholds():
        thr.tau.fill_(3.0)
        thr.seen.fill_(1.0)
    model.load_state_dict(saved)
    assert all(thr.tau.item() == 3.0 and thr.seen.item() == 1.0 for thr in model.router_thresholds())
    fresh = small_model(static_routing_mode=True, mod_capacity=0.5)
    fresh.load_state_dict(saved)
    assert all(thr.seen.item() == 0 for thr in fresh.router_thresholds())


@pytest.mark.parametrize("k_share", [0.1, 0.5, 1.0])
def test_take_first_k_equals_a_stable_sort_of_taken_first(k_share):
    # reference: Python's stable sort on (not taken, time) of each row, fresh random decisions
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    b, n = 4, 97
    taken = torch.rand(b, n, generator=g) < float(torch.rand((), generator=g))
    k = max(1, round(k_share * n))
    idx, member = take_first_k(taken, k)
    for row in range(b):
        order = sorted(range(n), key=lambda t: (not bool(taken[row, t]), t))[:k]
        assert idx[row].tolist() == order, f"seed {seed}, row {row}"
        count = int(taken[row].sum())
        assert member[row].tolist() == [j < count for j in range(k)], f"seed {seed}, row {row}"
