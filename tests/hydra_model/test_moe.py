"""MoE FFN: every dispatch path against a per-token loop in fp64; balancing and statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hydra_model.moe as moe_mod
from hydra_model import MoEFFN, moe_dispatch_counts


def per_token_reference(moe: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_j w_j · expert_{e_j}(x_t), one token at a time, fp64."""
    xf = x.reshape(-1, moe.dim).double()
    probs = (xf @ moe.router.weight.double().t()).softmax(-1)
    scores = probs + moe.balance_bias.double() if moe.balancing == "loss_free" else probs
    h = moe.hidden
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        chosen = scores[t].topk(moe.top_k).indices.tolist()
        weights = probs[t, chosen]
        if moe.top_k > 1:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            gu = xf[t] @ moe.w_gate_up[e].double()
            out[t] += w * (F.silu(gu[:h]) * gu[h:]) @ moe.w_down[e].double()
    return out.reshape(x.shape)


def _grouped_mm_runs_on_cpu() -> bool:
    try:
        torch._grouped_mm(
            torch.randn(3, 16), torch.randn(2, 16, 16), offs=torch.tensor([1, 3], dtype=torch.int32)
        )
        return True
    except Exception:
        return False


PATHS = ["loop", "masked"] + (
    ["grouped_mm"] if hasattr(torch, "_grouped_mm") and _grouped_mm_runs_on_cpu() else []
)


@pytest.fixture(autouse=True)
def _auto_dispatch():
    yield
    moe_mod.force_moe_dispatch(None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("top_k", "balancing"), [(1, "aux_loss"), (2, "aux_loss"), (2, "loss_free")])
def test_dispatch_matches_per_token_loop(path, top_k, balancing):
    torch.manual_seed(0)
    moe = MoEFFN(16, 32, n_experts=5, top_k=top_k, balancing=balancing)
    with torch.no_grad():
        moe.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4]))
        moe.router.weight.mul_(10)  # spread the routing over experts
    x = torch.randn(3, 7, 16)
    moe_mod.force_moe_dispatch(path)
    before = moe_dispatch_counts().get(path, 0)
    y, _ = moe(x)
    assert moe_dispatch_counts()[path] == before + 1
    torch.testing.assert_close(y.double(), per_token_reference(moe, x), atol=1e-5, rtol=1e-5)


def test_gradients_agree_between_loop_and_masked_paths():
    torch.manual_seed(1)
    moe = MoEFFN(12, 20, n_experts=3, top_k=2)
    x = torch.randn(2, 9, 12)
    grads = {}
    for path in ("loop", "masked"):
        moe.zero_grad()
        moe_mod.force_moe_dispatch(path)
        y, loss = moe(x)
        ((y**2).sum() + loss).backward()
        grads[path] = [p.grad.clone() for p in moe.parameters()]
    for a, b in zip(grads["loop"], grads["masked"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(g.abs().sum() > 0 for g in grads["loop"])  # router included: weights carry its gradient


def test_aux_loss_is_switch_balance_and_stats_match_hand_computation():
    torch.manual_seed(2)
    moe = MoEFFN(8, 8, n_experts=4, top_k=1)
    moe.train()
    x = torch.randn(40, 8)
    moe.reset_stats()
    _, loss = moe(x)
    probs = (x @ moe.router.weight.t()).softmax(-1)
    top = probs.argmax(-1)
    frac = torch.bincount(top, minlength=4).float() / 40
    torch.testing.assert_close(loss, 4 * (frac * probs.mean(0)).sum())
    stats = moe.routing_stats()
    torch.testing.assert_close(stats["utilization"], frac)
    ent = -(probs * probs.log()).sum(-1).mean()
    torch.testing.assert_close(stats["entropy"], ent)
    kl = sum(f * math.log(f * 4) for f in frac.tolist() if f > 0)
    assert stats["kl_to_uniform"].item() == pytest.approx(kl, abs=1e-5)
    assert stats["max_violation"].item() == pytest.approx(frac.max().item() * 4 - 1, abs=1e-6)


def test_valid_mask_excludes_filler_tokens_from_stats():
    torch.manual_seed(3)
    moe = MoEFFN(8, 8, n_experts=2, top_k=1)
    x = torch.randn(1, 6, 8)
    valid = torch.tensor([[True, True, True, False, False, False]])
    moe.reset_stats()
    moe(x, valid)
    assert moe.stat_load.sum().item() == 3
    assert moe.stat_entropy[1].item() == 3


def test_loss_free_bias_moves_towards_balance():
    torch.manual_seed(4)
    moe = MoEFFN(8, 8, n_experts=3, top_k=1, balancing="loss_free", bias_update_rate=0.01)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0].fill_(1.0)  # with positive inputs expert 0 takes every token
    moe.train()
    x = torch.rand(10, 8)
    _, loss = moe(x)
    assert loss is None  # no auxiliary loss in loss-free mode
    assert moe.pending_load.tolist() == [10.0, 0.0, 0.0]
    moe.apply_bias_update()
    assert moe.balance_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01])
    assert moe.pending_load.sum() == 0
    moe.apply_bias_update()  # nothing pending: no change
    assert moe.balance_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01])
