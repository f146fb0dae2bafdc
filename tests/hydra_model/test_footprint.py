"""FLOP accounting against a hand count; memory estimate behaves as its assumptions say."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_model import compute_memory_footprint, create_ccgqa_mod_mor_model, preset_config
from hydra_model.config import HYDRA_V2_100M, HydraConfig
from hydra_model.footprint import flops_breakdown

from .conftest import small_config


def _hand_flops(cfg, seq, executed):
    """Forward FLOPs written out term by term, times 3 for the training step."""
    e, d, hq, hkv = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q, kv = hq * d, hkv * d
    total = 0.0
    for block in range(cfg.n_mor_blocks):
        routed = executed and cfg.mod_routed(block)
        n = math.ceil(cfg.mod_capacity * seq) if routed else seq
        parent = cfg.mod_capacity if routed else 1.0
        for cap in cfg.mor_capacity_schedule:
            if not executed or cap >= 1:
                m = n
            elif cfg.routing == "causal":  # budget ⌈parent · cap · S⌉ of the whole sequence
                m = min(n, math.ceil(parent * cap * seq - 1e-9))
            else:  # expert choice: top ⌈cap · n⌉ of the MoD-selected n
                m = math.ceil(cap * n)
            per_token = (
                2 * e * (q + 2 * kv)  # W_q, W_k, W_v1, W_v2
                + 2 * (q + kv) * cfg.conv_kernel_seq  # depthwise conv
                + 2 * (q + kv) * d * cfg.conv_kernel_ch  # head-wise conv
                + 2 * q * (m + 1)  # QKᵀ and PV over a causal m-token sequence
                + 2 * q * e  # W_o
                + 6 * e * cfg.mlp_hidden  # SwiGLU
            )
            total += per_token * m
        total += 2 * e * seq * (1 if cfg.mod_routed(block) else 0) + 2 * e * cfg.recursions_per_block * seq
    total += 2 * e * cfg.vocab_size * seq
    return 3 * total / seq


@pytest.mark.parametrize("routing", ["causal", "expert_choice"])
@pytest.mark.parametrize("executed", [True, False])
def test_flops_match_hand_count(executed, routing):
    cfg = small_config(n_mor_blocks=4, mod_capacity=0.6, routing=routing)
    for seq in (7, 64):
        model = create_ccgqa_mod_mor_model("tiny", **cfg.to_dict())
        assert model.flops_per_token(seq, executed=executed) == pytest.approx(
            _hand_flops(cfg, seq, executed), rel=1e-3
        )


def test_executed_flops_are_below_dense_only_when_routing_skips_work():
    for routed, share in ((preset_config("100M"), 0.75), (HydraConfig(**HYDRA_V2_100M), 0.6)):
        assert sum(r["flops"] for r in flops_breakdown(routed, 2048, True)) < share * sum(
            r["flops"] for r in flops_breakdown(routed, 2048, False)
        )
    for mode in (
        dict(static_routing_mode=True),
        dict(routing_off=True),
        dict(mor_routing="token_choice", mod_capacity=1.0),
    ):
        cfg = preset_config("100M", **mode)
        a = sum(r["flops"] for r in flops_breakdown(cfg, 2048, True))
        b = sum(r["flops"] for r in flops_breakdown(cfg, 2048, False))
        assert a == pytest.approx(b), mode


def test_memory_footprint_scales_and_reflects_options():
    with torch.device("meta"):
        model = create_ccgqa_mod_mor_model("100M")
    a = compute_memory_footprint(model, 4, 1024)
    b = compute_memory_footprint(model, 8, 1024)
    assert a["parameters"] == model.num_parameters()
    assert a["parameter_mb"] == pytest.approx(model.num_parameters() * 4 / 2**20)
    assert b["activation_mb"] == pytest.approx(2 * a["activation_mb"])
    assert b["estimated_training_mb"] > a["estimated_training_mb"]
    model.enable_gradient_checkpointing(every=1)
    c = compute_memory_footprint(model, 8, 1024)
    assert c["activation_mb"] < 0.5 * b["activation_mb"]
    chunked = compute_memory_footprint(preset_config("100M", use_chunked_ce=True), 8, 1024)
    assert chunked["logits_mb"] == 0 and b["logits_mb"] > 0
    assert compute_memory_footprint(preset_config("100M"), 8, 1024)["estimated_training_mb"] == pytest.approx(
        b["estimated_training_mb"]
    )
