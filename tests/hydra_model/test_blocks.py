"""Routing semantics of the blocks (the expert-choice ablation): MoD top-k and threshold, MoR
capacity schedule and nesting, token choice, gathered tokens keep their positions, static ==
dynamic at capacity 1. Causal routing has its own module, test_causal_routing.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import hydra_model.routing_expert_choice as expert_choice_mod
from hydra_model import CCGQAMoDBlockWrapper
from hydra_model.blocks import RunContext
from hydra_model.routing_rules import router_input

from .conftest import random_tokens, small_config, small_model


def _ctx(cfg):
    from hydra_model import RotaryEmbedding

    return RunContext(RotaryEmbedding(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_base))


def test_mod_training_routes_exactly_top_k_and_weights_the_update():
    cfg = small_config(mod_capacity=0.4, mod_dense_first_last=False, routing="expert_choice")
    torch.manual_seed(0)
    wrapper = CCGQAMoDBlockWrapper(cfg, 1).train()
    ctx = _ctx(cfg)
    h = torch.randn(2, 13, cfg.dim)
    out, aux = wrapper(h, None, ctx)
    k = math.ceil(0.4 * 13)
    logit = wrapper.router(router_input(h)).squeeze(-1)
    top = logit.topk(k, dim=-1).indices.sort(-1).values
    changed = (out - h).abs().amax(-1) > 0
    for b in range(2):
        assert changed[b].nonzero().flatten().tolist() == top[b].tolist()
    # the selected tokens, run alone as a sub-sequence with their ORIGINAL positions
    hs = torch.stack([h[b, top[b]] for b in range(2)])
    ref_out, _ = wrapper.mor(hs, top, None, ctx)
    w = torch.sigmoid(torch.stack([logit[b, top[b]] for b in range(2)])).unsqueeze(-1)
    got = torch.stack([out[b, top[b]] for b in range(2)])
    torch.testing.assert_close(got, hs + w * (ref_out - hs), atol=1e-5, rtol=1e-5)
    assert set(aux) >= {"mod_router", "mor_router", "router_z"}
    assert wrapper.stat_mod[0].item() == pytest.approx(k / 13)


def test_positions_matter_for_gathered_tokens():
    """Same tokens, other positions → other outputs: RoPE really sees the original positions."""
    cfg = small_config(mod_dense_first_last=False)
    torch.manual_seed(1)
    wrapper = CCGQAMoDBlockWrapper(cfg, 0).train()
    hs = torch.randn(1, 5, cfg.dim)
    a, _ = wrapper.mor(hs, torch.tensor([[0, 1, 2, 3, 4]]), None, _ctx(cfg))
    b, _ = wrapper.mor(hs, torch.tensor([[0, 3, 5, 6, 9]]), None, _ctx(cfg))
    assert (a - b).abs().max() > 1e-4


def test_mor_expert_choice_follows_the_capacity_schedule_and_nests(monkeypatch):
    cfg = small_config(
        recursions_per_block=4, mod_dense_first_last=True, n_mor_blocks=1, routing="expert_choice"
    )
    torch.manual_seed(2)
    wrapper = CCGQAMoDBlockWrapper(cfg, 0).train()
    picked = []
    real = expert_choice_mod.expert_choice_select

    def spy(*args):
        out = real(*args)
        picked.append(set(out[1][0].tolist()))  # idx [B, k] of the chosen tokens
        return out

    monkeypatch.setattr(expert_choice_mod, "expert_choice_select", spy)
    n = 17
    wrapper(torch.randn(1, n, cfg.dim), None, _ctx(cfg))
    sizes = [math.ceil(c * n) for c in cfg.mor_capacity_schedule]
    assert [len(p) for p in picked] == sizes[1:]  # recursion 0 has capacity 1: no top-k
    assert all(later <= earlier for earlier, later in itertools.pairwise(picked))
    assert wrapper.mor.stat_depth[0].item() == pytest.approx(sum(sizes) / n)
    hist = wrapper.mor.stat_depth_hist
    torch.testing.assert_close(hist.sum(), torch.tensor(1.0))


def test_eval_routes_by_threshold_on_the_router():
    cfg = small_config(mod_dense_first_last=False, mod_capacity=0.5, routing="expert_choice")
    torch.manual_seed(3)
    wrapper = CCGQAMoDBlockWrapper(cfg, 0).eval()
    h = torch.randn(3, 19, cfg.dim)
    with torch.no_grad():
        out, aux = wrapper(h, None, _ctx(cfg))
    chosen = wrapper.router(router_input(h)).squeeze(-1) > 0
    assert 0 < chosen.float().mean() < 1
    changed = (out - h).abs().amax(-1) > 0
    assert torch.equal(changed, chosen)
    assert wrapper.stat_mod[0].item() == pytest.approx(chosen.float().mean().item())
    assert aux.get("mod_router") is None  # no top-k in eval, so no membership target


def test_token_choice_depth_is_the_argmax_of_the_router():
    cfg = small_config(mor_routing="token_choice", n_mor_blocks=1)
    torch.manual_seed(4)
    wrapper = CCGQAMoDBlockWrapper(cfg, 0).train()
    h = torch.randn(2, 11, cfg.dim)
    _, aux = wrapper(h, None, _ctx(cfg))
    depth = wrapper.mor.router(router_input(h)).argmax(-1) + 1
    assert wrapper.mor.stat_depth[0].item() == pytest.approx(depth.float().mean().item())
    assert "mor_balance" in aux and "mor_router" not in aux


@pytest.mark.parametrize("moe", [False, True])
def test_static_equals_dynamic_at_capacity_one(moe):
    """With every capacity at 1.0, dynamic routing selects every token everywhere, so it must
    compute exactly what static (soft) routing computes: same logits, CE, auxiliary losses and
    gradients of every parameter, in training and in eval."""
    extra = dict(moe_enabled=True, moe_num_experts=3) if moe else {}
    static = small_model(static_routing_mode=True, **extra)
    dynamic = small_model(mod_capacity=1.0, mor_capacities=(1.0, 1.0, 1.0), **extra)
    # the static model keeps causal thresholds for a switch to dynamic routing; at capacity 1
    # nothing is decided, so the dynamic model has none
    dynamic.load_state_dict({k: v for k, v in static.state_dict().items() if ".threshold." not in k})
    x, y = random_tokens(2, 15), random_tokens(2, 15, seed=7)
    outs = {}
    for name, model in (("static", static), ("dynamic", dynamic)):
        model.train()
        out = model(x, targets=y)
        out.loss.backward()
        outs[name] = (out, {n: p.grad for n, p in model.named_parameters()})
        model.eval()
        with torch.no_grad():
            outs[name + "_eval"] = model(x).logits
    (s, sg), (d, dg) = outs["static"], outs["dynamic"]
    torch.testing.assert_close(d.logits, s.logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(d.ce_loss, s.ce_loss)
    assert d.aux_losses.keys() == s.aux_losses.keys()
    torch.testing.assert_close(d.loss, s.loss)
    for n in sg:
        torch.testing.assert_close(dg[n], sg[n], atol=1e-6, rtol=1e-5, msg=n)
    torch.testing.assert_close(outs["dynamic_eval"], outs["static_eval"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", [{}, {"static_routing_mode": True}, {"mor_routing": "token_choice"}])
def test_ponder_penalty_trains_the_recursion_router(mode):
    cfg = small_config(ponder_weight=0.5, n_mor_blocks=1, **mode)
    torch.manual_seed(6)
    wrapper = CCGQAMoDBlockWrapper(cfg, 0).train()
    _, aux = wrapper(torch.randn(2, 9, cfg.dim), None, _ctx(cfg))
    (ponder,) = aux["ponder"]
    assert 0 < ponder.item() <= 1
    ponder.backward()
    assert wrapper.mor.router.weight.grad.abs().sum() > 0
