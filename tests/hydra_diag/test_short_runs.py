"""short_runs.py: settings split between TrainConfig and HydraConfig; a run reports its FLOPs."""

from __future__ import annotations

import pytest

from hydra_diag.output import DiagError
from hydra_diag.short_runs import run_short_training, split_settings


def test_split_settings():
    train, model = split_settings(
        {"lr": 1e-3, "warmup_steps": 3, "mod_capacity": 0.5, "recursions_per_block": 3}
    )
    assert train == {"lr": 1e-3, "warmup_steps": 3} and model == {
        "mod_capacity": 0.5,
        "recursions_per_block": 3,
    }
    with pytest.raises(DiagError, match="speed"):
        split_settings({"speed": 2})


def test_a_short_run_reports_its_compute(tmp_path):
    s = run_short_training(
        model_size="tiny",
        steps=3,
        settings={"dim": 32},
        vocab_size=64,
        seq_len=16,
        batch_size=2,
        device="cpu",
        out_dir=tmp_path,
    )
    assert s["steps"] == 3 and s["tokens_seen"] == 3 * 2 * 16
    assert s["train_flops"] == pytest.approx(s["flops_per_token"] * s["tokens_seen"])
    assert s["flops_per_token"] <= s["flops_per_token_dense"]
    assert s["kept_in"] == str(tmp_path) and (tmp_path / "checkpoints" / "training.db").is_file()
