"""What a person sees: plain progress lines off a terminal; the DB callback's rows and commits."""

from __future__ import annotations

import io

from rich.console import Console

from hydra_train.metrics_db import TrainingDB
from hydra_train.reporting import MetricsDBCallback, ProgressCallback


def _row(step, **kw):
    row = dict(
        step=step,
        time=0.0,
        loss=4.5,
        ce_loss=4.4,
        aux_loss=0.1,
        aux={"mor_router": 0.1},
        lr=1e-3,
        grad_norm=0.5,
        tokens_per_s=1234.0,
        tokens_seen=100 * step,
        memory_mb=10.0,
        skipped_steps=0,
        ema_short=4.6,
        ema_medium=4.7,
        ema_long=4.8,
        lr_phase="cosine",
        base_lr=2e-3,
    )
    row.update(kw)
    return row


def test_progress_lines_when_not_a_terminal():
    buf = io.StringIO()
    now = [100.0]
    cb = ProgressCallback(Console(file=buf, width=200), total_steps=10, clock=lambda: now[0])
    assert not cb.live
    cb.on_train_start(type("T", (), {"step": 0})())
    now[0] = 100.0 + 65.0  # 5 steps in 65 s: 13 s a step, 5 steps left
    cb.on_log(5, _row(5, skipped_steps=2))
    cb.on_eval(5, 4.25)
    cb.on_train_end({})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("step      5/10  loss 4.5000") and "1,234 tok/s" in lines[0]
    assert "lr 1.00e-03" in lines[0] and "skipped 2" in lines[0]
    assert lines[0].endswith("elapsed 0:01:05  ETA 0:01:05")
    assert lines[1] == "step      5/10  validation loss 4.2500  elapsed 0:01:05  ETA 0:01:05"


def test_progress_eta_counts_from_the_resumed_step():
    """A resumed run at step 90 of 100: the speed is measured over the steps this process ran."""
    buf = io.StringIO()
    now = [0.0]
    cb = ProgressCallback(Console(file=buf, width=200), total_steps=100, clock=lambda: now[0])
    cb.on_train_start(type("T", (), {"step": 90})())
    now[0] = 3725.0  # 5 steps in 1 h 2 min 5 s; 5 more take as long
    cb.on_log(95, _row(95))
    assert buf.getvalue().rstrip().endswith("elapsed 1:02:05  ETA 1:02:05")


class _NoRoutingModel:
    pass


def test_db_callback_writes_and_exports(tmp_path, capsys):
    db = TrainingDB(tmp_path / "training.db")
    db.upsert_model("m", "tiny", 10, 5, {})
    db.start_run("r", "m", 0, {})
    cb = MetricsDBCallback(db, "r", tmp_path, announce_commits=True)
    cb.on_train_start(type("T", (), {"model": _NoRoutingModel()})())
    cb.on_log(2, _row(2))
    cb.on_eval(2, 4.0)
    assert "[metrics_db] committed step 2" in capsys.readouterr().out
    other = TrainingDB(tmp_path / "training.db")  # a second connection sees the committed rows
    assert other.query("SELECT step, loss, lr FROM steps") == [{"step": 2, "loss": 4.5, "lr": 1e-3}]
    assert other.query("SELECT phase, factor FROM adaptive_lr") == [{"phase": "cosine", "factor": 0.5}]
    other.close()
    cb.on_train_end({"status": "finished", "steps": 2, "best_loss": 4.5, "final_val_loss": 4.0})
    assert (tmp_path / "diagnostics_r.json").is_file()
    assert db.runs()[0]["status"] == "finished"
    db.close()
