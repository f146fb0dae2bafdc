"""footprint.py against an independent count: torch's FlopCounterMode on a training forward.

The counter sees the matmuls (the FFN, MoE experts and router, attention projections) but not
CPU SDPA, and CCGQA's convs run as folded window products whose FLOPs differ from the conv's own
by design, so the comparison is per part: every FFN application (which tokens each routed block
and recursion really ran) and, for plain GQA (routing off), the attention projections."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hydra_model.footprint import applications, block_forward_flops

from .conftest import MODES, random_tokens, small_model


def _measured(model, seq: int) -> dict[str, int]:
    """Forward FLOPs of the FFN and attention modules of one training forward at length ``seq``."""
    model.train()
    with FlopCounterMode(display=False, depth=None) as counter, torch.no_grad():
        model(random_tokens(2, seq))
    out = {"ffn": 0, "attn": 0}
    for name, per_op in counter.get_flop_counts().items():
        for part in out:
            if name.endswith(f".{part}"):
                out[part] += sum(per_op.values())
    return out


def _analytic(cfg, seq: int, part: str) -> float:
    """Forward FLOPs of ``part`` summed over the applications footprint.py counts, batch 2."""
    return (
        2
        * seq
        * sum(
            block_forward_flops(cfg, app.context)[part] * app.token_fraction
            for app in applications(cfg, seq, executed=True)
        )
    )


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seq", [5, 13])
def test_executed_ffn_flops_match_the_flop_counter(mode, seq):
    model = small_model(mod_capacity=0.4, **MODES[mode])
    assert _measured(model, seq)["ffn"] == pytest.approx(_analytic(model.config, seq, "ffn"), rel=1e-9)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mor_capacities=(1.0, 0.9, 0.2), mod_capacity=0.3),  # causal budgets under a small MoD
        dict(routing="expert_choice", mor_capacities=(0.5, 0.3, 0.1), mod_capacity=0.3),
    ],
)
def test_uneven_capacity_schedules_match_the_flop_counter(overrides):
    model = small_model(**overrides)
    for seq in (1, 13, 33):
        assert _measured(model, seq)["ffn"] == pytest.approx(_analytic(model.config, seq, "ffn"), rel=1e-9)


def test_gqa_projection_flops_match_the_flop_counter():
    model = small_model(**MODES["routing_off"])
    assert _measured(model, 13)["attn"] == pytest.approx(_analytic(model.config, 13, "attn_proj"), rel=1e-9)


def test_parameter_count_is_every_distinct_tensor_once():
    for mode in MODES.values():
        model = small_model(**mode)
        distinct = {id(p): p.numel() for p in model.parameters()}
        assert model.num_parameters() == sum(distinct.values())
        assert model.num_parameters(True) == sum(distinct.values()) - model.embed.weight.numel()
