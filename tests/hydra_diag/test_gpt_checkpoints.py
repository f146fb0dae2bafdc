"""A dense GPT checkpoint given to the diagnostics: the general ones (health model) work on it, the
ones that read HYDRA's routers and experts refuse it with one line and exit 1, never a traceback."""

from __future__ import annotations

import pytest
import torch

from hydra_model import build_model

from .conftest import invoke, last_error_line, run_json

GPT_VOCAB = 61


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("gpt", "tiny", vocab_size=GPT_VOCAB, dim=32, n_layers=2, head_dim=8, mlp_hidden=64)
    payload = {"format": "hydra-train-checkpoint", "step": 3, "model": model.state_dict()}
    payload["config"] = {"model": model.config.to_dict(), "train": {"arch": "gpt"}}
    path = tmp_path_factory.mktemp("gpt") / "hydra_gpt-tiny_step3.pt"
    torch.save(payload, path)
    return path


def test_health_model_checks_a_gpt_checkpoint(runner, gpt_checkpoint):
    out = run_json(runner, ["health", "model", "--checkpoint", gpt_checkpoint, "--seq_len", 16])
    assert out["passed"] and out["model"]["vocab_size"] == GPT_VOCAB
    assert out["model"]["moe"] is False


@pytest.mark.parametrize(
    "args",
    [
        ["health", "routing", "--dataset", "random", "--seq_len", 16, "--no_plot"],
        ["analyze", "deep-diagnosis", "--dataset", "random", "--seq_len", 16, "--no_plot"],
        ["moe", "weight-balance", "--no_plot"],
        ["moe", "specialization", "--mode", "weights", "--no_plot"],
        ["moe", "specialization", "--dataset", "random", "--seq_len", 16, "--no_plot"],
    ],
)
def test_hydra_only_tools_refuse_a_gpt_checkpoint(runner, gpt_checkpoint, args):
    res = invoke(runner, [*args, "--checkpoint", gpt_checkpoint])
    assert res.exit_code == 1, res.output
    assert "GPT" in last_error_line(res)


def test_watchdog_reports_a_gpt_checkpoint_instead_of_crashing(gpt_checkpoint):
    from hydra_diag.watchdog import WatchThresholds, poll_once
    from hydra_train.metrics_db import TrainingDB

    folder = gpt_checkpoint.parent
    with TrainingDB(folder / "training.db") as db:
        db.conn.execute("INSERT INTO runs (run_id, model_id, status) VALUES ('r', 'gpt-tiny', 'finished')")
        db.conn.commit()
    report = poll_once(folder, None, WatchThresholds(), {})
    assert "GPT" in report["checkpoint"]["error"]
    assert any(a["kind"] == "no_moe" for a in report["alerts"])
