"""routing_health.py and `hydra-diag health routing`: statistics, collapse detection, the heat-map PNG."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_diag.loading import build_model
from hydra_diag.routing_health import detect_routing_problems, expected_depth_hist, routing_health

from .conftest import TINY, VOCAB, assert_png, run_json


def test_expected_depth_hist_by_hand():
    assert expected_depth_hist([1.0, 0.5]) == [0.0, 0.5, 0.5]
    hist = expected_depth_hist([1.0, 0.75, 0.5, 0.25])
    assert hist == pytest.approx([0.0, 0.25, 0.25, 0.25, 0.25])
    assert sum(expected_depth_hist([0.9, 0.3])) == pytest.approx(1.0)


def test_cli_on_the_run_checkpoint_writes_heat_maps(runner, tiny_run, tmp_path):
    png = tmp_path / "routing.png"
    out = run_json(
        runner, ["health", "routing", "--checkpoint", tiny_run.folder, "--seq_len", 32, "--plot", png]
    )
    assert_png(png)
    assert out["plot"] == str(png)
    assert "bigram" not in out["data"] and "shard" in out["data"]  # the run's own data, not random tokens
    mod_train = out["train"]["mod"]
    assert [r["layer"] for r in mod_train] == [1]  # only the middle block is MoD-routed
    # causal routing takes at most its budget ⌈0.75·32⌉ of each sequence, and evaluation takes
    # exactly what training takes
    assert 0 < mod_train[0]["selected_frac"] <= math.ceil(0.75 * 32) / 32
    assert out["eval"]["mod"][0]["selected_frac"] == pytest.approx(mod_train[0]["selected_frac"])
    for mode in ("train", "eval"):
        for row in out[mode]["mor"]:
            assert sum(row["depth_hist"]) == pytest.approx(1.0, abs=1e-5)
        for row in out[mode]["moe"]:
            assert sum(row["utilization"]) == pytest.approx(1.0, abs=1e-5)
        # the probe's recomputed expert choices agree with the model's own counts
        assert out[mode]["probe_vs_model_max_diff"] < 1e-6
    # MoR depths stay within the capacity schedule's budgets (at most the expected share reaches
    # each depth or beyond), and evaluation routes as training does
    for row, ev in zip(out["train"]["mor"], out["eval"]["mor"], strict=True):
        reach = [sum(row["depth_hist"][d:]) for d in range(1, len(row["depth_hist"]))]
        cap = [sum(out["expected_depth_hist"][d:]) for d in range(1, len(row["depth_hist"]))]
        assert all(a <= b + 1e-6 for a, b in zip(reach, cap, strict=True))
        assert row["depth_hist"] == pytest.approx(ev["depth_hist"], abs=1e-6)


def _planted(**kw):
    model = build_model(
        "tiny", {**TINY, "vocab_size": VOCAB, "moe_enabled": True, "moe_balancing": "loss_free", **kw}
    )
    with torch.no_grad():
        model.blocks[1].router.weight.zero_()
        model.blocks[1].router.bias.fill_(10.0)  # every token says yes with the same score
        for blk in model.blocks:
            blk.mor.block.ffn.balance_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # expert 0 always wins
    return model


def test_planted_collapsed_routers_are_flagged():
    out = routing_health(model=_planted(), seq_len=32, device="cpu")
    kinds = {(f["kind"], f["layer"]) for f in out["findings"]}
    assert ("mod_router_collapsed", 1) in kinds
    assert ("mod_selects_all_or_none", 1) in kinds
    assert all(("moe_collapsed", i) in kinds and ("moe_dead_experts", i) in kinds for i in range(3))
    assert out["healthy"] is False
    # the diagnostic left the model's buffers as it found them (the loss-free bias included)
    assert out["eval"]["moe"][0]["utilization"][0] == pytest.approx(1.0)


def test_a_fresh_model_has_no_error_findings():
    model = build_model("tiny", {**TINY, "vocab_size": VOCAB, "moe_enabled": True})
    before = {n: b.clone() for n, b in model.named_buffers()}
    out = routing_health(model=model, seq_len=32, device="cpu")
    assert [f for f in out["findings"] if f["severity"] == "error"] == []
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


def test_detection_thresholds_on_synthetic_stats():
    caps = {"mod_capacity": 0.75, "mor_capacities": [1.0, 0.5]}
    report = {
        "train": {
            "mod": [],
            "mor": [],
            "moe": [
                {"layer": 0, "utilization": [0.49, 0.49, 0.01, 0.01], "top_k": 2, "max_violation": 0.96},
                {"layer": 1, "utilization": [0.25, 0.25, 0.25, 0.25], "top_k": 1, "max_violation": 0.0},
                {"layer": 3, "utilization": [0.4, 0.3, 0.2, 0.1], "top_k": 2, "max_violation": 0.6},
            ],
        },
        "eval": {
            "mod": [{"layer": 1, "selected_frac": 0.3, "logit_std": 0.5}],
            "mor": [{"layer": 2, "depth_hist": [0.0, 0.99, 0.01]}],
            "moe": [],
        },
    }
    found = {(f["kind"], f["layer"]) for f in detect_routing_problems(report, caps)}
    # top-2 with shares 0.49: expert 0 is among the two chosen for 98% of tokens, experts 2, 3 starve
    assert ("moe_collapsed", 0) in found and ("moe_dead_experts", 0) in found
    # balanced, and a skewed but working top-2 layer (0.4·2 = 80% of tokens): nothing flagged
    assert not any(layer in (1, 3) and kind.startswith("moe") for kind, layer in found)
    assert ("mod_eval_capacity_gap", 1) in found
    assert ("mor_depth_collapsed", 2) in found
