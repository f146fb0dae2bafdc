"""moe_analysis.py and `hydra-diag moe specialization` / `moe weight-balance`."""

from __future__ import annotations

import pytest
import torch

from hydra_diag.loading import build_model
from hydra_diag.moe_analysis import token_purity, weight_balance
from hydra_model.checkpoint_digest import CHECKSUM_KEY, payload_digest

from .conftest import TINY, VOCAB, assert_png, invoke, last_error_line, run_json


def test_weight_balance_matches_the_checkpoint_weights(runner, tiny_run, tmp_path):
    png = tmp_path / "wb.png"
    out = run_json(runner, ["moe", "weight-balance", "--checkpoint", tiny_run.final, "--plot", png])
    assert_png(png)
    state = torch.load(tiny_run.final, weights_only=True)["model"]
    assert [lay["layer"] for lay in out["layers"]] == [0, 1, 2]
    for lay in out["layers"]:
        w = state[f"blocks.{lay['layer']}.mor.block.ffn.w_gate_up"]
        for e in lay["experts"]:
            assert e["gate_up_norm"] == pytest.approx(float(w[e["expert"]].norm()), rel=1e-5)
        norms = [e["gate_up_norm"] for e in lay["experts"]]
        assert lay["gate_up_imbalance"] == pytest.approx(max(norms) / min(norms), rel=1e-6)


def test_a_planted_outlier_expert_is_flagged(tiny_run, tmp_path):
    ck = torch.load(tiny_run.final, weights_only=True)
    ck["model"]["blocks.1.mor.block.ffn.w_gate_up"][2] *= 5.0
    ck[CHECKSUM_KEY] = payload_digest(ck)  # a planted checkpoint, written as hydra-train writes one
    path = tmp_path / "hydra_tiny_step99.pt"
    torch.save(ck, path)
    out = weight_balance(str(path))
    flagged = [(f["layer"], f["message"]) for f in out["findings"]]
    assert any(layer == 1 and "expert 2" in msg for layer, msg in flagged)
    assert all(layer == 1 for layer, _ in flagged)


def test_specialization_weights_mode(runner, tiny_run, tmp_path):
    png = tmp_path / "sw.png"
    out = run_json(
        runner, ["moe", "specialization", "--checkpoint", tiny_run.final, "--mode", "weights", "--plot", png]
    )
    assert_png(png)
    for lay in out["layers"]:
        sim = lay["expert_similarity"]
        assert all(sim[i][i] == pytest.approx(1.0) for i in range(len(sim)))
        assert all(sim[i][j] == pytest.approx(sim[j][i]) for i in range(len(sim)) for j in range(len(sim)))
        # independently initialised experts after 16 steps: nearly orthogonal
        assert abs(lay["mean_expert_similarity"]) < 0.2


def test_specialization_inference_mode(runner, tiny_run, tmp_path):
    png = tmp_path / "si.png"
    out = run_json(
        runner,
        [
            "moe",
            "specialization",
            "--checkpoint",
            tiny_run.final,
            "--seq_len",
            32,
            "--batches",
            2,
            "--batch_size",
            4,
            "--device",
            "cpu",
            "--plot",
            png,
        ],
    )
    assert_png(png)
    assert out["mode"] == "inference" and out["routing"] == "eval"
    for lay in out["layers"]:
        assert sum(e["share"] for e in lay["experts"]) == pytest.approx(1.0)
        if lay["layer"] in (0, 2):  # unrouted blocks: their first recursion sees the tokens in order
            assert sum(e["ordered_tokens"] for e in lay["experts"]) == 2 * 4 * 32
            assert 0.0 < lay["token_purity"] <= 1.0
        for e in lay["experts"]:
            assert e["mean_prob"] is None or 0.0 < e["mean_prob"] <= 1.0
            assert all(t["share"] <= 1.0 for t in e["top_tokens"])


def test_token_purity_by_hand():
    pairs = [(5, 0)] * 3 + [(5, 1)] + [(7, 2)] * 4 + [(9, 1)]  # token 9 seen once: below min_count
    purity, used = token_purity(pairs, min_count=2)
    assert used == 2 and purity == pytest.approx((3 + 4) / 8)
    assert token_purity([], 1) == (None, 0)


def test_a_dense_checkpoint_is_refused(runner, tmp_path):
    model = build_model("tiny", {**TINY, "vocab_size": VOCAB})
    model.save_pretrained(tmp_path / "dense")
    res = invoke(runner, ["moe", "weight-balance", "--checkpoint", tmp_path / "dense"])
    assert res.exit_code == 1 and "no MoE layers" in last_error_line(res)


def test_a_nan_expert_is_flagged_and_the_table_still_prints(runner, tiny_run, tmp_path):
    # its norms are NaN: the imbalance (None in the JSON-able result) crashed the table's title
    ck = torch.load(tiny_run.final, weights_only=True)
    ck["model"]["blocks.0.mor.block.ffn.w_gate_up"][1] = float("nan")
    ck[CHECKSUM_KEY] = payload_digest(ck)
    path = tmp_path / "hydra_tiny_step98.pt"
    torch.save(ck, path)
    res = invoke(runner, ["moe", "weight-balance", "--checkpoint", path, "--no_plot"])
    assert res.exit_code == 0, res.output
    out = weight_balance(str(path))
    assert any(f["kind"] == "nonfinite_weights" and f["layer"] == 0 for f in out["findings"])
