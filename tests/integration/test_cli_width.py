"""Every ``--help`` of the four command lines, and ``hydra-train db stats``, at 80 columns: no line
wider than the terminal and no ellipsis (rich's mark for a cut cell)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from hydra_diag.cli import app as diag_app
from hydra_kernels.cli import app as kernels_app
from hydra_model.cli import app as model_app
from hydra_train.cli import app as train_app

APPS = {
    "hydra-kernels": kernels_app,
    "hydra-model": model_app,
    "hydra-train": train_app,
    "hydra-diag": diag_app,
}


def command_paths(cmd, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    if hasattr(cmd, "commands"):  # a group (Typer's own click copy or click's)
        for name, sub in cmd.commands.items():
            out += command_paths(sub, (*prefix, name))
    return out


def all_help_pages() -> list[tuple[str, tuple[str, ...]]]:
    return [(n, p) for n, a in APPS.items() for p in command_paths(typer.main.get_command(a))]


@pytest.mark.parametrize(
    ("prog", "path"), all_help_pages(), ids=lambda x: " ".join(x) if isinstance(x, tuple) else x
)
def test_help_fits_80_columns_uncut(prog, path):
    res = CliRunner().invoke(APPS[prog], [*path, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    wide = [line for line in res.output.splitlines() if len(line) > 80]
    assert not wide, wide


def test_option_spellings_are_whole_in_help():
    """Every spelling of every option of ``hydra-train run`` appears whole, and choices show."""
    res = CliRunner().invoke(train_app, ["run", "--help"], env={"COLUMNS": "80"})
    shown = set(re.findall(r"--[A-Za-z0-9][\w-]*", res.output))
    run_cmd = typer.main.get_command(train_app).commands["run"]
    spellings = {s for p in run_cmd.params for s in (*p.opts, *p.secondary_opts) if s.startswith("--")}
    assert spellings and not spellings - shown, sorted(spellings - shown)
    for choices in ("hydra|gpt", "testing|production", "cosine|wsd", "auto|bf16|fp32", "e4m3|e5m2"):
        assert choices in res.output, choices


def test_db_stats_numbers_are_whole_at_80_columns(tmp_path):
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    db = TrainingDB(tmp_path / DB_NAME)
    big = 287_654_321
    db.upsert_model("tiny", "tiny", big, big - 1_000_000, {"dim": 64})
    db.start_run("r1", "tiny", 0, {}, device="cpu", world_size=1)
    for step in range(1, 4):
        db.log_step(
            "r1",
            step,
            time=float(step),
            loss=4.87654321 / step,
            ce_loss=4.8,
            aux_loss=0.0,
            aux={},
            lr=1e-3,
            grad_norm=1.0,
            tokens_per_s=12345.678,
            tokens_seen=123_456_789 * step,
            memory_mb=100.0,
            skipped_steps=0,
            ema_short=4.8123,
            ema_medium=4.9,
            ema_long=4.95,
        )
    db.log_eval("r1", 3, 4.123456)
    db.commit()
    db.close()
    env = dict(os.environ, COLUMNS="80")
    res = subprocess.run(
        [sys.executable, "-m", "hydra_train", "db", "stats", "--checkpoint_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines()), res.stdout
    assert str(big) in res.stdout and str(123_456_789 * 3) in res.stdout  # whole numbers, not 287…
    assert "4.812" in res.stdout  # ema_short, 4 significant digits
