"""Inference cost: counted eval-forward FLOPs (the routed model executes fewer than the dense GPT
of its size, and only the rows it gathers) and the `bench inference` command on the CPU."""

from __future__ import annotations

import pytest

from hydra_diag.inference_bench import count_eval_flops
from hydra_model import build_model
from hydra_model.footprint import flops_per_token

from .conftest import run_json


def test_routed_eval_forward_executes_fewer_flops_than_the_dense_gpt():
    hydra = count_eval_flops("hydra", "100M", 2048, {})
    gpt = count_eval_flops("gpt", "100M", 2048, {})
    assert abs(hydra["parameters"] / gpt["parameters"] - 1) < 0.10  # the same size
    assert hydra["eval_flops_per_token"] < 0.95 * gpt["eval_flops_per_token"]
    # the count agrees with the analytic count of the gathered rows (forward = training / 3)
    analytic = flops_per_token(build_model("hydra", "100M").config, 2048) / 3
    assert hydra["eval_flops_per_token"] == pytest.approx(analytic, rel=0.05)


def test_causal_routing_computes_only_the_gathered_rows_at_inference():
    """The expert-choice ablation evaluates by a threshold over a permutation of every row (no
    saving); causal routing gathers ⌈c·S⌉ rows in evaluation as in training."""
    causal = count_eval_flops("hydra", "100M", 1024, {})
    expert = count_eval_flops("hydra", "100M", 1024, {"routing": "expert_choice"})
    dense = count_eval_flops("hydra", "100M", 1024, {"mod_enabled": False, "mor_enabled": False})
    assert causal["eval_flops_per_token"] < 0.8 * expert["eval_flops_per_token"]
    # and the saving counted on the real forward is the one the analytic accounting predicts
    from hydra_model.config import preset_config
    from hydra_model.footprint import flops_per_token

    cfg = preset_config("100M")
    predicted = flops_per_token(cfg, 1024, executed=True) / flops_per_token(cfg, 1024, executed=False)
    assert causal["eval_flops_per_token"] / expert["eval_flops_per_token"] == pytest.approx(
        predicted, rel=0.02
    )
    assert expert["eval_flops_per_token"] == pytest.approx(dense["eval_flops_per_token"], rel=0.02)


def test_bench_inference_on_the_cpu(runner):
    out = run_json(
        runner,
        [
            "bench", "inference", "--model_size", "tiny", "--configs", "gpt,hydra", "--device", "cpu",
            "--new_tokens", 4, "--prompt_len", 5, "--repeats", 1, "--flops_seq_len", 64,
            "--decode", "eager,staged",
        ],
    )  # fmt: skip
    rows = {(r["config"], r["decode"]): r for r in out["rows"]}
    assert set(rows) == {(c, d) for c in ("gpt", "hydra") for d in ("eager", "staged")}
    for r in rows.values():
        assert r["new_tokens"] == 4 and r["tokens_per_s"] > 0 and r["eval_flops_per_token"] > 0
        assert r["decode_report"]["steps"] == 3  # the last timed generation: 3 steps after the prompt
        assert r["tokens_per_s_new_decoder"] > 0
        # staged: the timed calls replayed the decoder their predecessor kept; eager keeps none
        assert r["decode_report"]["reused"] == (r["decode"] == "staged")
        assert not r["decode_report_new_decoder"]["reused"]
        assert r["tokens_agree_with_first_mode"] == 1.0  # fp32 on the CPU: the same tokens
