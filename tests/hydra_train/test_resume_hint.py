"""The hint an interrupted ``hydra-train run`` prints looks for the checkpoints of its own model,
as ``--resume`` does: another model's checkpoints in the same folder (a finished tiny HYDRA run,
then ``--arch gpt`` interrupted before its first save) made it suggest ``--resume``, which was then
refused ("holds no checkpoint of model gpt-tiny")."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import hydra_train.run as run_mod
from hydra_train.cli import app
from hydra_train.cli_errors import resume_hint
from hydra_train.config import TrainConfig

runner = CliRunner()


def _interrupted(monkeypatch, args: list[str]) -> str:
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "run_training", stop)
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 130, res.output
    return " ".join(res.stderr.split())


def test_another_models_checkpoints_do_not_suggest_resume(monkeypatch, tmp_path):
    ck = tmp_path / "same"
    ck.mkdir()
    (ck / "hydra_tiny_final.pt").write_bytes(b"")  # a finished tiny HYDRA run
    line = _interrupted(monkeypatch, ["--arch", "gpt", "--checkpoint_dir", str(ck)])
    assert "--resume" not in line and "no checkpoint was saved yet" in line, line


def test_its_own_models_checkpoint_suggests_resume(monkeypatch, tmp_path):
    ck = tmp_path / "same"
    ck.mkdir()
    (ck / "hydra_tiny_final.pt").write_bytes(b"")
    (ck / "hydra_gpt-tiny_step10.pt").write_bytes(b"")
    line = _interrupted(monkeypatch, ["--arch", "gpt", "--checkpoint_dir", str(ck)])
    assert line.endswith(f"--arch gpt --checkpoint_dir {ck} --resume"), line


@pytest.mark.parametrize(
    ("kw", "saved", "resumes"),
    [
        # --model_size auto on the CPU is the tiny preset, as the run resolves it
        ({}, "hydra_tiny_step5.pt", True),
        ({"model_size": "debug"}, "hydra_tiny_step5.pt", False),
        ({"model_size": "debug"}, "hydra_debug_step5.pt", True),
        ({"arch": "gpt", "model_size": "tiny"}, "hydra_tiny_step5.pt", False),
    ],
)
def test_the_hint_names_resume_only_for_this_runs_model(tmp_path: Path, kw, saved, resumes):
    (tmp_path / saved).write_bytes(b"")
    hint = resume_hint(TrainConfig(checkpoint_dir=str(tmp_path), device="cpu", **kw))
    assert hint.endswith("--resume") == resumes, hint
