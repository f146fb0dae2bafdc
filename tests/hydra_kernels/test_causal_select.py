"""causal_select: a whole sequence's causal routing selection (Triton, interpreted on the CPU)
against a hand-written loop of the recurrence (C(t) = min(C(t−1) + p(t), budget(t))) and the
op-by-op PyTorch reference, on fresh random logits, candidates and positions; the seed is in
every failure message. Decisions are integers: every output must be equal, not close."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import causal_select as cs_mod
from hydra_kernels.ops.causal_select import causal_select, causal_select_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON

BITS = 20
ONE = 1 << BITS


def loop_select(logit, tau, candidates, pos, cap_q, k):
    """The rule token by token, in Python: first come, first served within the budget."""
    b, n = logit.shape
    taken = torch.zeros(b, n, dtype=torch.bool)
    for row in range(b):
        count, budget_seen = 0, 0
        for t in range(n):
            p = pos[row, t].item() if pos is not None else t
            budget_seen = max(budget_seen, -(-(p + 1) * cap_q // ONE))  # ⌈cap · (p + 1)⌉, running max
            passes = logit[row, t].item() > tau.item() and (candidates is None or bool(candidates[row, t]))
            if passes and count < budget_seen:
                taken[row, t] = True
                count += 1
    idx = torch.zeros(b, k, dtype=torch.long)
    for row in range(b):
        order = [t for t in range(n) if taken[row, t]] + [t for t in range(n) if not taken[row, t]]
        idx[row] = torch.tensor(order[:k])
    total = taken.sum(1)
    member = torch.arange(k).unsqueeze(0) < total.unsqueeze(1)
    p = torch.arange(n).expand(b, n) if pos is None else pos
    return taken, idx, member, p.gather(1, idx), (idx + torch.arange(b).unsqueeze(1) * n).reshape(-1), total


def random_case(b, n, with_cand, with_pos, seed):
    g = torch.Generator().manual_seed(seed)
    logit = torch.randn(b, n, generator=g)
    tau = torch.tensor(float(torch.randn((), generator=g)) * 0.5)
    cand = torch.rand(b, n, generator=g) < 0.6 if with_cand else None
    # positions of a routed sub-sequence: increasing, with gaps
    pos = torch.cumsum(torch.randint(1, 4, (b, n), generator=g), 1) - 1 if with_pos else None
    cap_q = int(torch.randint(ONE // 16, ONE, (), generator=g))
    k = int(torch.randint(1, n + 1, (), generator=g))
    return logit, tau, cand, pos, cap_q, k


@pytest.mark.parametrize(("b", "n"), [(1, 1), (2, 7), (3, 64), (2, 300)])
@pytest.mark.parametrize("with_cand", [False, True])
@pytest.mark.parametrize("with_pos", [False, True])
def test_causal_select_equals_the_token_by_token_rule_and_the_reference(seed, b, n, with_cand, with_pos):
    logit, tau, cand, pos, cap_q, k = random_case(b, n, with_cand, with_pos, seed)
    want = loop_select(logit, tau, cand, pos, cap_q, k)
    ref = causal_select_ref(logit, tau, cand, pos, cap_q, BITS, ONE, k)
    falls = controls.fallback_counts().get("causal_select", 0)
    on = lambda t: None if t is None else t.to(DEVICE)
    got = causal_select(on(logit), on(tau), on(cand), on(pos), cap_q, BITS, ONE, k)
    assert controls.fallback_counts().get("causal_select", 0) == falls  # the kernel ran
    names = ("taken", "idx", "member", "pos_k", "flat", "count")
    for name, w, r, g in zip(names, want, ref, got, strict=True):
        assert torch.equal(r, w), f"seed {seed}: reference {name}"
        assert torch.equal(g.cpu(), w), f"seed {seed}: kernel {name}"


def test_a_strided_logit_and_a_counter_written_in_place(seed):
    """Logits as a strided view of a wider buffer, the count written into a given counter."""
    logit, tau, cand, _, cap_q, k = random_case(2, 40, True, False, seed)
    wide = torch.randn(2, 50)
    wide[:, :40] = logit
    view = wide[:, :40].to(DEVICE)
    counter = torch.full((2,), -5, dtype=torch.long, device=DEVICE)
    falls = controls.fallback_counts().get("causal_select", 0)
    got = causal_select(view, tau.to(DEVICE), cand.to(DEVICE), None, cap_q, BITS, ONE, k, count_out=counter)
    assert controls.fallback_counts().get("causal_select", 0) == falls
    want = loop_select(view.cpu(), tau, cand, None, cap_q, k)
    assert got[-1] is counter and torch.equal(counter.cpu(), want[-1]), f"seed {seed}"
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_logits_not_in_fp32_compare_in_their_own_dtype(dtype, monkeypatch):
    """The kernel compares in fp32; fp64 or half-precision logits take the reference, which
    compares as PyTorch does (a logit just above tau in fp64 is taken; a bf16 logit against an
    fp32 tau compares in bf16), as hydra_model's op-by-op rule would."""
    monkeypatch.setattr(cs_mod, "causal_select_launch", lambda *a, **k: pytest.fail("the kernel ran"))
    tau = torch.tensor(0.1, dtype=torch.float32, device=DEVICE)
    logit = torch.full((1, 4), 0.1, dtype=dtype, device=DEVICE)
    logit[0, ::2] = (0.1 + 1e-12) if dtype == torch.float64 else 0.1
    got = causal_select(logit, tau, None, None, ONE, BITS, ONE, 4)
    assert torch.equal(got[0], logit > tau)


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    logit = torch.randn(2, 9, device=DEVICE)
    tau = torch.zeros((), device=DEVICE)
    controls.set_op_enabled("causal_select", False)
    want = causal_select_ref(logit, tau, None, None, ONE // 2, BITS, ONE, 5)
    got = causal_select(logit, tau, None, None, ONE // 2, BITS, ONE, 5)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(ValueError, match=r"k=10 must be in \[1, n=9\]"):
        causal_select(logit, tau, None, None, ONE // 2, BITS, ONE, 10)
    with pytest.raises(ValueError, match="pos must be"):
        causal_select(logit, tau, None, torch.zeros(2, 9, device=DEVICE), ONE // 2, BITS, ONE, 5)


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"LOGIT": "*fp32", "TAU": "*fp32", "CAND": "*i1", "POS": "*i64", "TAKEN": "*i1", "IDX": "*i64",
           "MEMBER": "*i1", "POS_K": "*i64", "FLAT": "*i64", "COUNT": "*i64", "stride_l": "i32",
           "stride_c": "i32", "stride_p": "i32", "cap_q": "i32"}  # fmt: skip
    consts = {"N": 2048, "K": 256, "BLOCK": 2048, "BLOCK_K": 256, "HAS_CAND": True, "HAS_POS": True,
              "CAP_BITS": BITS, "CAP_ONE": ONE}  # fmt: skip
    build_sm90(cs_mod._causal_select_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
