"""router_decide: the fused decode-time routing decision (Triton, interpreted on CPU) against an
fp64 oracle and the op-by-op PyTorch reference.

The logit is internal to the kernel, so it is checked through what it decides: weight = σ(logit)
against σ of the fp64 logit (hydra_kernels.numerics' criterion), and taken flipping exactly where
tau crosses the fp64 logit. Decisions (taken, count, flag) must equal the oracle's exactly except
for rows whose fp64 logit lies within a small tolerance of tau, where fp32 rounding may go either
way. Inputs are fresh random each test; the seed is in every failure message.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import router_decide as rd_mod
from hydra_kernels.ops.router_decide import router_decide, router_decide_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON

BITS = 20
ONE = 1 << BITS
EPS = 1e-6
#: |logit64 − tau| below this (relative to max(1, |logit|)) may round either way in fp32
NEAR = 1e-4


@dataclass
class Case:
    h: torch.Tensor  # [B, E], possibly a strided view
    w: torch.Tensor  # [E]
    b: torch.Tensor  # []
    tau: torch.Tensor  # []
    pos: torch.Tensor  # [B] long, possibly strided
    count: torch.Tensor  # [B] long
    cap_q: int

    def run(self, fn=router_decide, tau: torch.Tensor | None = None):
        """(taken, weight, flag, count after) from ``fn`` on a copy of the counter."""
        n = self.h.shape[0]
        count = self.count.clone()
        taken = torch.zeros(n, dtype=torch.bool, device=DEVICE)
        weight = torch.full((n,), -1.0, device=DEVICE)
        flag = torch.tensor(False, device=DEVICE)
        fn(self.h, self.w, self.b, self.tau if tau is None else tau, self.pos, count, self.cap_q, BITS, ONE,
           EPS, taken, weight, flag)  # fmt: skip
        return taken, weight, flag, count

    def logit64(self) -> torch.Tensor:
        """The router logit [B] in fp64 from the (rounded) inputs."""
        h, w, b = self.h.double(), self.w.double(), self.b.double()
        return (h @ w) / torch.sqrt(h.pow(2).mean(-1) + EPS) + b

    def budget(self) -> torch.Tensor:
        """⌈cap · (pos + 1)⌉ [B], computed independently of the ops' shift arithmetic."""
        return torch.tensor([math.ceil((p + 1) * self.cap_q / ONE) for p in self.pos.tolist()], device=DEVICE)

    def near(self, tau: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [B] whose fp64 logit is within the rounding tolerance of tau."""
        logit = self.logit64()
        t = float(self.tau if tau is None else tau)
        return (logit - t).abs() <= NEAR * logit.abs().clamp(min=1.0)


def make_case(
    batch: int, dim: int, dtype: torch.dtype, *, strided: bool, binding: bool, cap: float = 0.25
) -> Case:
    """Random inputs; tau at the logits' median so about half the rows pass it. ``binding``: half
    the counters (at random) sit at their row's budget, so the budget refuses tokens that pass
    tau; otherwise every counter is below its budget."""
    if strided:  # rows of a wider buffer, as h[:, 0, :] of a [B, S, E] stream; pos every other entry
        h = torch.randn(batch, dim + 24, device=DEVICE).to(dtype)[:, 8 : 8 + dim]
        pos = torch.randint(0, 64, (batch, 2), device=DEVICE)[:, 1]
    else:
        h = torch.randn(batch, dim, device=DEVICE).to(dtype)
        pos = torch.randint(0, 64, (batch,), device=DEVICE)
    w = (torch.randn(dim, device=DEVICE) / math.sqrt(dim) * 3).to(dtype)
    b = (0.2 * torch.randn((), device=DEVICE)).to(dtype)
    cap_q = max(1, round(cap * ONE))
    count = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    case = Case(h, w, b, torch.zeros((), device=DEVICE), pos, count, cap_q)
    case.tau = case.logit64().median().float() + 0.01  # not exactly on a row's logit
    budget = case.budget()
    if binding:
        at_budget = torch.rand(batch, device=DEVICE) < 0.5
        case.count = torch.where(at_budget, budget, (budget - 1).clamp(min=0))
    else:
        case.count = (budget - 1 - torch.randint(0, 3, (batch,), device=DEVICE)).clamp(min=0)
    return case


def oracle(case: Case, tau: torch.Tensor | None = None):
    """(taken, count after) from the fp64 logit and the independent budget."""
    t = float(case.tau if tau is None else tau)
    taken = (case.logit64() > t) & (case.count < case.budget())
    return taken, case.count + taken.long()


def mismatches(case: Case, out, tau: torch.Tensor | None = None) -> list[str]:
    """What ``out`` = (taken, weight, flag, count) gets wrong against the oracle, rows near tau
    left out of the exact comparisons."""
    taken, _, flag, count = out
    want_taken, want_count = oracle(case, tau)
    far = ~case.near(tau)
    bad = []
    if not torch.equal(taken[far], want_taken[far]):
        bad.append(f"taken {taken.tolist()} vs {want_taken.tolist()} (near tau: {(~far).tolist()})")
    if not torch.equal(count[far], want_count[far]):
        bad.append(f"count {count.tolist()} vs {want_count.tolist()}")
    if not torch.equal(count - case.count, taken.long()):  # near rows too: count moves with taken
        bad.append(f"count moved {(count - case.count).tolist()} where taken is {taken.tolist()}")
    if bool(flag) != bool(taken.any()):
        bad.append(f"flag {bool(flag)} but taken {taken.tolist()}")
    return bad


def check(case: Case, seed: int):
    out = case.run()
    bad = mismatches(case, out)
    assert not bad, f"seed={seed}: " + "; ".join(bad)
    # weight: |kernel − fp64| ≤ 2·|reference − fp64| + atol
    w64 = torch.sigmoid(case.logit64())
    ref = case.run(router_decide_ref)
    assert out[1].dtype == torch.float32
    res = check_against_fp64(out[1], ref[1], w64, atol=fp32_noise_atol(w64, ulps=64))
    assert res.passed, f"weight (seed={seed}): {res.describe()}"
    # the reference decides as the kernel does away from tau
    far = ~case.near()
    assert torch.equal(out[0][far], ref[0][far]) and torch.equal(out[3][far], ref[3][far]), f"seed={seed}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 5, 19])  # 19: more rows than one tile holds
@pytest.mark.parametrize("binding", [False, True])
def test_decisions_equal_the_fp64_oracle(dtype, batch, binding, seed):
    for _ in range(4):  # several draws: a batch of 1 is one decision
        case = make_case(batch, 96, dtype, strided=False, binding=binding)
        check(case, seed)


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("dim", [40, 2500])  # 2500: E is looped over in tiles, with a ragged tail
def test_strided_rows_and_positions(batch, dim, seed):
    case = make_case(batch, dim, torch.bfloat16, strided=True, binding=True)
    assert case.h.stride(0) != dim and case.pos.stride(0) == 2
    check(case, seed)


def _strided_like(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another layout: ``columns`` (h [B, E] as the transpose of an [E, B]
    buffer: E strided by B), ``every_other`` (a vector at every other entry of a wider one)."""
    if layout == "columns":
        return t.t().contiguous().t()
    return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


@pytest.mark.parametrize("layout", ["h columns", "h every_other", "w every_other"])
def test_strided_h_columns_and_w_run_the_kernel(layout, seed):
    """h's E and w read at any stride, by the kernel: such a layout was refused by the launcher, a
    counted fallback to the reference for a layout the kernel reads by passing its strides (a
    copy instead would allocate inside a captured decode step). E = 2500 loops over E tiles."""
    name, how = layout.split()
    for batch, dim in ((3, 40), (2, 2500)):
        case = make_case(batch, dim, torch.bfloat16, strided=False, binding=True)
        setattr(case, name, _strided_like(getattr(case, name), how))
        assert getattr(case, name).stride(-1) != 1
        check(case, seed)
    assert controls.fallback_counts().get("router_decide", 0) == 0, f"seed={seed}: the reference ran"


def test_the_budget_binds_and_does_not(seed):
    """Every row clears tau (tau = −∞): at their budget none is taken, below it all are."""
    case = make_case(8, 64, torch.float32, strided=False, binding=False)
    case.tau = torch.tensor(-math.inf, device=DEVICE)
    case.count = case.budget()
    taken, _, flag, count = case.run()
    assert not taken.any() and not bool(flag) and torch.equal(count, case.count), f"seed={seed}"
    case.count = case.budget() - 1
    taken, _, flag, count = case.run()
    assert taken.all() and bool(flag) and torch.equal(count, case.budget()), f"seed={seed}"


def test_count_advances_only_where_taken(seed):
    """Mixed rows: some fail tau, some are refused by the budget, some are taken; only the taken
    rows' counters move, each by one, in the caller's tensor (in place); the flag tells any."""
    case = make_case(12, 64, torch.bfloat16, strided=False, binding=True)
    before = case.count.clone()
    count = case.count.clone()
    ptr = count.data_ptr()
    taken = torch.zeros(12, dtype=torch.bool, device=DEVICE)
    weight, flag = torch.zeros(12, device=DEVICE), torch.tensor(True, device=DEVICE)
    router_decide(
        case.h, case.w, case.b, case.tau, case.pos, count, case.cap_q, BITS, ONE, EPS, taken, weight, flag
    )
    assert count.data_ptr() == ptr
    assert torch.equal(count[~taken], before[~taken]), f"seed={seed}"
    assert torch.equal(count[taken], before[taken] + 1), f"seed={seed}"
    assert bool(flag) == bool(taken.any())
    passed = case.logit64() > float(case.tau)
    refused = passed & (before >= case.budget()) & ~case.near()
    assert not taken[refused].any(), f"seed={seed}: a row over its budget was taken"
    # nothing taken: the flag says so and no counter moves
    case.tau = torch.tensor(math.inf, device=DEVICE)
    taken, _, flag, count = case.run()
    assert not bool(flag) and torch.equal(count, case.count)


def test_tau_decides_at_the_fp64_logit(seed):
    """tau just below / above each row's fp64 logit: the row is taken / not. This pins the fused
    logit to the fp64 one within the tolerance (a wrong norm, eps or bias would flip rows)."""
    case = make_case(6, 80, torch.bfloat16, strided=True, binding=False)
    logit = case.logit64()
    for i in range(6):
        delta = 2 * NEAR * max(1.0, abs(float(logit[i])))
        below = case.run(tau=torch.tensor(float(logit[i]) - delta, device=DEVICE))[0]
        above = case.run(tau=torch.tensor(float(logit[i]) + delta, device=DEVICE))[0]
        assert below[i] and not above[i], f"row {i} (seed={seed}): logit {float(logit[i])}"


def test_a_wrong_tau_is_caught(seed):
    """The checks can fail: decisions made with a shifted tau disagree with the oracle."""
    case = make_case(16, 64, torch.float32, strided=False, binding=False)
    case.tau = torch.tensor(float(case.logit64().min()) - 1.0, device=DEVICE)  # every row passes
    wrong = case.run(tau=torch.tensor(float(case.logit64().max()) + 1.0, device=DEVICE))  # none passes
    assert mismatches(case, wrong), f"seed={seed}: a decision with the wrong tau passed the check"
    assert not mismatches(case, case.run()), f"seed={seed}"


def test_tau_and_bias_in_bf16_are_read_as_fp32(seed):
    """A model cast to bf16 holds tau and the router's bias in bf16: both are read exactly."""
    case = make_case(7, 64, torch.bfloat16, strided=False, binding=True)
    case.tau = case.tau.to(torch.bfloat16)
    check(case, seed)


def test_the_kernel_runs_and_the_switch_picks_the_reference(monkeypatch, seed):
    case = make_case(4, 32, torch.float32, strided=False, binding=False)

    def refuse(*args):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(rd_mod, "router_decide_ref", refuse)
    case.run()  # the kernel
    controls.set_use_triton_kernels(False)
    with pytest.raises(AssertionError, match="the reference ran"):
        case.run()
    monkeypatch.undo()
    assert not mismatches(case, case.run())  # the reference, switched to, decides the same


def test_bad_arguments_raise():
    case = make_case(3, 32, torch.float32, strided=False, binding=False)
    taken, weight = torch.zeros(3, dtype=torch.bool, device=DEVICE), torch.zeros(3, device=DEVICE)
    outs = (taken, weight, torch.tensor(False, device=DEVICE))
    consts = (case.cap_q, BITS, ONE, EPS)
    with pytest.raises(ValueError, match="count"):
        router_decide(case.h, case.w, case.b, case.tau, case.pos, case.count.int(), *consts, *outs)
    with pytest.raises(ValueError, match=r"\[B, E\]"):
        router_decide(case.h[None], case.w, case.b, case.tau, case.pos, case.count, *consts, *outs)


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below): E's strides at 1, as
    Triton specialises them for the usual layouts, and at run-time values."""
    sig = {"H": "*bf16", "W": "*bf16", "BIAS": "*bf16", "TAU": "*fp32", "POS": "*i64", "COUNT": "*i64",
           "TAKEN": "*i1", "WEIGHT": "*fp32", "FLAG": "*i1", "stride_h": "i32", "stride_pos": "i32",
           "stride_count": "i32", "stride_taken": "i32", "stride_weight": "i32", "cap_q": "i32",
           "eps": "fp32"}  # fmt: skip
    consts = {"N_ROWS": 3, "DIM": 768, "BLOCK_B": 4, "BLOCK_E": 1024, "CAP_BITS": BITS, "CAP_ONE": ONE}
    build_sm90(rd_mod._router_decide_kernel, sig, {**consts, "stride_h_e": 1, "stride_w": 1}, 4, 1)
    build_sm90(rd_mod._router_decide_kernel, {**sig, "stride_h_e": "i32", "stride_w": "i32"}, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
