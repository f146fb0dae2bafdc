"""What a user of ``hydra-train`` sees where it used to mislead: help text, the hint after Ctrl-C,
and the errors of ``tokenizer train`` and ``db ema`` (``--dry_run``'s cases: test_dry_run.py)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

import hydra_train.run as run_mod
from hydra_train.cli import app

runner = CliRunner()


def _flat(text: str) -> str:
    """Help text with the panel's borders and line breaks gone, words single-spaced."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_help_keeps_bracketed_text():
    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    # rich markup ate "[tokens, vocab]" out of --chunked_ce's help
    assert "no full [tokens, vocab] logits" in _flat(res.output)
    # a one-word switch was listed twice in each form
    assert "--compile, --compile" not in _flat(res.output)


def _interrupt(monkeypatch):
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "run_training", stop)


def test_ctrl_c_hint_repeats_the_runs_flags(monkeypatch, tmp_path):
    _interrupt(monkeypatch)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "hydra_tiny_step60.pt").write_bytes(b"")
    args = ["run", "--seq_len", "32", "--batch_size", "2", "--checkpoint_dir", str(ck)]
    res = runner.invoke(app, [*args, "--model_override", "dim=64", "--no-experimental_fa3"])
    assert res.exit_code == 130, res.output
    hint = " ".join(res.stderr.split()).split("continue with: ")[1]
    # a resume refuses another --seq_len, so the hint must carry it (it only named the folder)
    assert hint == (
        f"hydra-train run --model_override dim=64 --batch_size 2 --seq_len 32 --checkpoint_dir {ck} "
        "--no-experimental_fa3 --resume"
    )


def test_ctrl_c_before_the_first_checkpoint_does_not_suggest_resume(monkeypatch, tmp_path):
    _interrupt(monkeypatch)
    res = runner.invoke(app, ["run", "--checkpoint_dir", str(tmp_path / "none")])
    assert res.exit_code == 130, res.output
    line = " ".join(res.stderr.split())
    # --resume there is refused: "holds no checkpoint of model tiny"
    assert "--resume" not in line and "no checkpoint was saved yet" in line, line


def test_tokenizer_train_on_token_shards_does_not_call_them_supported(tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"\0" * 64)
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path), "--out", str(tmp_path / "t.json")])
    assert res.exit_code == 1
    line = " ".join(res.output.split())
    # it said: "no supported data files (found .bin); supported: .bin, .pt, ..."
    supported = line.split("supported: ", 2)[-1]
    assert not supported.startswith(".bin") and ".txt" in supported, line


def test_db_ema_refuses_a_negative_limit(tmp_path):
    from hydra_train.metrics_db import DB_NAME

    (tmp_path / DB_NAME).write_bytes(b"")  # never opened: the option is refused first
    res = runner.invoke(app, ["db", "ema", "--checkpoint_dir", str(tmp_path), "--limit", "-1"])
    assert res.exit_code == 2 and "--limit" in res.output, res.output
