"""HydraConfig field checks: a value that would crash deep in the model build or forward, produce
NaNs, or be silently ignored is refused up front with a message that names the field; numpy
integers are accepted as ints (the config stays JSON)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hydra_model import HydraConfig, create_ccgqa_mod_mor_model, preset_config
from hydra_model.footprint import compute_memory_footprint, flops_per_token

from .conftest import SMALL, small_config


def test_numpy_integers_become_ints_and_the_config_stays_json(tmp_path):
    cfg = small_config(vocab_size=np.int64(97), dim=np.int32(48))
    assert type(cfg.vocab_size) is int and type(cfg.dim) is int
    json.dumps(cfg.to_dict())  # what save_pretrained writes
    create_ccgqa_mod_mor_model("tiny", **{**SMALL, "vocab_size": np.int64(97)}).save_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        # wrong types: each reached nn.Linear / torch.empty as a TypeError naming no field
        (dict(n_heads=2.0), "n_heads"),
        (dict(vocab_size=True), "vocab_size"),
        (dict(dim="256"), "dim"),
        (dict(mlp_ratio="4"), "mlp_ratio"),
        # ZeroDivisionError in mlp_hidden, an empty or negative MLP
        (dict(mlp_multiple_of=0), "mlp_multiple_of"),
        (dict(mlp_ratio=0.0), "mlp_ratio"),
        (dict(mlp_ratio=-1.0), "mlp_ratio"),
        (dict(moe_enabled=True, moe_expert_hidden=-4), "moe_expert_hidden"),
        (dict(moe_expert_hidden=1.5), "moe_expert_hidden"),
        # NaN losses (rsqrt of a negative, a zero rotary base) or a crash in the init
        (dict(norm_eps=-1.0), "norm_eps"),
        (dict(rope_base=0.0), "rope_base"),
        (dict(init_std=-0.1), "init_std"),
    ],
)
def test_bad_field_values_are_refused_naming_the_field(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        preset_config("tiny", **overrides)


def test_causal_routing_refuses_a_first_recursion_capacity_it_would_ignore():
    # the causal rule routes recursions 1.. only: recursion 0 took every token whatever
    # mor_capacities[0] said, so the model and its FLOP count disagreed
    with pytest.raises(ValueError, match=r"mor_capacities\[0\]"):
        small_config(mor_capacities=(0.5, 0.3, 0.1))
    # where it is honoured (expert choice) or nothing is routed, it stays accepted
    small_config(mor_capacities=(0.5, 0.3, 0.1), routing="expert_choice")
    small_config(mor_capacities=(0.5, 0.3, 0.1), mor_routing="token_choice")
    small_config(mor_capacities=(0.5, 0.3, 0.1), mor_enabled=False)


def test_flop_and_memory_estimates_refuse_an_empty_sequence():
    cfg = small_config()
    for seq in (0, -3):
        with pytest.raises(ValueError, match="seq_len"):
            flops_per_token(cfg, seq)
        with pytest.raises(ValueError, match="seq_len"):
            compute_memory_footprint(cfg, 2, seq)


def test_config_defaults_still_validate():
    HydraConfig()
    preset_config("tiny", moe_enabled=True, moe_expert_hidden=128, compression_factor=2)
