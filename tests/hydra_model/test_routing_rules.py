"""The routing-rule registry: every rule the blocks name is registered, a new rule is one class
registered by name (the config accepts it, the blocks build and run it), unknown names are
refused with the list."""

from __future__ import annotations

import pytest
import torch

from hydra_model import routing_rules
from hydra_model.blocks import CCGQAMoDBlockWrapper
from hydra_model.routing import SubSequence, flat_index, positions_or_arange
from hydra_model.routing_rules import ROUTING_RULES, RoutingRule, register_routing, routing_rule

from .conftest import random_tokens, small_config, small_model


def test_the_built_in_rules_are_registered():
    assert {"dense", "static", "token_choice", "causal", "expert_choice"} <= set(ROUTING_RULES)
    assert set(routing_rules.token_selection_rules()) >= {"causal", "expert_choice"}
    assert "dense" not in routing_rules.token_selection_rules()
    with pytest.raises(ValueError, match=r"registered: .*causal"):
        routing_rule("no_such_rule")
    with pytest.raises(ValueError, match="routing='no_such_rule'"):
        small_config(routing="no_such_rule")


class EvenPositions(RoutingRule):
    """A toy rule: MoD takes the tokens at even positions (a causal rule: it reads the position
    only); MoR runs every recursion on its candidates."""

    name = "even_positions"
    selects_tokens = True

    def mod_forward(self, wrapper, h, pos, ctx):
        b, s, _ = h.shape
        all_pos = positions_or_arange(pos, b, s, h.device)
        taken = all_pos % 2 == 0
        idx = torch.argsort((~taken).to(torch.int8), dim=1, stable=True)[:, : (s + 1) // 2]
        view = SubSequence(idx, all_pos.gather(1, idx), None, flat_index(idx, s))
        hs = view.gather(h)
        hs_out, aux = wrapper.mor(hs, view.pos, None, ctx)
        weight = torch.ones(b, s, device=h.device)
        wrapper.record_stats(taken.float().mean(), weight, taken.float().mean())
        return view.scatter_add(h, hs_out - hs), aux

    def mor_forward(self, block, h, pos, member, ctx, aux):
        return ROUTING_RULES["dense"].mor_forward(block, h, pos, member, ctx, aux)


@pytest.fixture
def even_rule(monkeypatch):
    monkeypatch.setattr(routing_rules, "ROUTING_RULES", dict(ROUTING_RULES))
    register_routing(EvenPositions)
    yield routing_rules.ROUTING_RULES["even_positions"]


def test_a_new_rule_is_one_registered_class(even_rule):
    with pytest.raises(ValueError, match="taken"):
        register_routing(EvenPositions)  # a name is registered once
    model = small_model(routing="even_positions", mod_dense_first_last=False, n_mor_blocks=2).train()
    assert model.blocks[0].mor.mode == "even_positions"
    x = random_tokens(2, 15, seed=3)
    out = model(x, targets=random_tokens(2, 15, seed=4))
    out.loss.backward()
    assert model.blocks[0].stat_mod[0].item() == pytest.approx(8 / 15)
    # the rule really decides: a routed block leaves the odd positions' stream untouched
    wrapper = model.blocks[0]
    h = torch.randn(1, 9, model.config.dim)
    from hydra_model.blocks import RunContext

    new_h, _ = wrapper(h, None, RunContext(model.rope, seq_len=9))
    moved = (new_h - h).abs().amax(-1)[0] > 0
    assert moved.tolist() == [t % 2 == 0 for t in range(9)]
    # causal, and evaluation routes as training does
    with torch.no_grad():
        a = model.eval()(x).logits
        x2 = x.clone()
        x2[:, 8:] = random_tokens(2, 7, seed=9)
        b = model(x2).logits
        torch.testing.assert_close(a[:, :8], b[:, :8])
        torch.testing.assert_close(model.train()(x).logits, a)


def test_a_rule_without_a_mod_part_says_so(even_rule):
    cfg = small_config(mod_dense_first_last=False)
    wrapper = CCGQAMoDBlockWrapper(cfg, 1)
    with pytest.raises(ValueError, match="does not route Mixture-of-Depths"):
        ROUTING_RULES["dense"].mod_forward(wrapper, torch.zeros(1, 3, cfg.dim), None, None)


def test_a_routed_wrapper_registers_its_router_after_its_block():
    """Parameters are drawn and initialised in registration order: keeping the MoD router after
    the MoR block keeps every seed's weights what they were when the race was run."""
    wrapper = CCGQAMoDBlockWrapper(small_config(mod_dense_first_last=False), 1)
    names = [n for n, _ in wrapper.named_parameters()]
    assert names[-2:] == ["router.weight", "router.bias"] and names[0].startswith("mor.")


def test_export_refuses_a_rule_it_has_no_implementation_for(even_rule):
    """The shipped Hugging Face code implements the registered rules it knows; any other is
    refused, never exported as something that computes differently."""
    from hydra_model.hf_hydra import UnsupportedModelError, hydra_layout

    model = small_model(routing="even_positions", mod_dense_first_last=False, recursions_per_block=1)
    with pytest.raises(UnsupportedModelError, match="even_positions"):
        hydra_layout(model)


def test_a_rule_running_the_dense_recursions_still_reports_depth_r(even_rule):
    """Dense blocks record no depth statistics, but a rule of its own that reuses the dense rule's
    recursions (as EvenPositions does) reports every token R deep, as before."""
    model = small_model(routing="even_positions", mod_dense_first_last=False, n_mor_blocks=2).train()
    model(random_tokens(2, 15, seed=3), targets=random_tokens(2, 15, seed=4)).loss.backward()
    mor = model.routing_stats()["mor"]
    assert mor and all(float(s["avg_depth"]) == model.config.recursions_per_block for s in mor)
    assert all(float(s["depth_hist"].sum()) == pytest.approx(1.0) for s in mor)
