"""`hydra-diag dashboard`: each bad input is one line and exit 1; the real command serves and
stops on Ctrl-C; SafeOptimizations events are replayed into a status per optimization."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys

from .conftest import invoke, one_line_error, synthetic_db
from .dashboard_helpers import get_json

ROW = dict(loss=3.0, lr=1e-3, grad_norm=1.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0)


def test_missing_database(runner, tmp_path):
    one_line_error(invoke(runner, ["dashboard", tmp_path / "nowhere"]), "no metrics database", "nowhere")
    one_line_error(invoke(runner, ["dashboard", tmp_path]), "no metrics database", "training.db")


def test_not_sqlite(runner, tmp_path):
    (tmp_path / "training.db").write_text("step,loss\n1,3.0\n")
    one_line_error(invoke(runner, ["dashboard", tmp_path]), "is not an SQLite database")


def test_empty_file_and_empty_database(runner, tmp_path):
    from hydra_train.metrics_db import TrainingDB

    db = tmp_path / "training.db"
    db.write_bytes(b"")
    one_line_error(invoke(runner, ["dashboard", db]), "empty file")
    db.unlink()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version=1")  # a valid database file with no tables at all
    conn.commit()
    conn.close()
    one_line_error(invoke(runner, ["dashboard", db]), "empty database (no tables)")
    db.unlink()
    TrainingDB(db).close()  # hydra-train's schema, no run yet
    one_line_error(invoke(runner, ["dashboard", db]), "holds no runs yet")


def test_older_schema(runner, tmp_path):
    """The steps table of an older hydra-train, without the EMAs, and no adaptive_lr table."""
    from hydra_train.metrics_db import SCHEMA

    conn = sqlite3.connect(tmp_path / "training.db")
    for table, cols in SCHEMA.items():
        if table == "adaptive_lr":
            continue
        if table == "steps":
            cols = ", ".join(c for c in cols.split(", ") if not c.startswith("ema_"))
        conn.execute(f"CREATE TABLE {table} ({cols})")
    conn.execute("INSERT INTO runs (run_id, status) VALUES ('old', 'finished')")
    conn.commit()
    conn.close()
    one_line_error(
        invoke(runner, ["dashboard", tmp_path]),
        "older schema",
        "steps lacks ema_short, ema_medium, ema_long",
        "no table adaptive_lr",
        "hydra-train db rebuild",
    )


def test_port_in_use(runner, tmp_path):
    synthetic_db(tmp_path, [dict(step=1, **ROW)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(
            invoke(runner, ["dashboard", tmp_path, "--port", port]), f"port {port} on 127.0.0.1", "in use"
        )


def test_the_command_serves_until_ctrl_c(tmp_path):
    """The installed entry point, as a person runs it: prints its URL, serves, exits 0 on SIGINT."""
    synthetic_db(tmp_path, [dict(step=s, **ROW) for s in (1, 2, 3)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_diag", "dashboard", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        line = proc.stdout.readline()
        assert "dashboard of" in line and "http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        runs = get_json(url + "api/runs")["runs"]
        assert [(r["run_id"], r["last_step"]) for r in runs] == [("run1", 3)]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0, proc.stderr.read()


def test_safe_opts_status_replays_the_event_log(tmp_path):
    """Events inside the run's time span only, replayed as SafeOptimizations' transitions."""
    from hydra_diag.dashboard.safe_events import events_path, safe_opts_report

    run = {"started_at": "2026-01-01T10:00:00.500", "ended_at": "2026-01-01T11:00:00.000"}
    events = [
        {"time": "2026-01-01T09:59:59", "step": 0, "event": "pretest", "name": "compile", "status": "FAIL"},
        {"time": "2026-01-01T10:00:00", "step": 0, "event": "pretest", "name": "compile", "status": "PASS"},
        {
            "time": "2026-01-01T10:00:00",
            "step": 0,
            "event": "pretest",
            "name": "fp8",
            "status": "N/A",
            "reason": "no GPU",
        },
        {
            "time": "2026-01-01T10:00:01",
            "step": 0,
            "event": "pretest",
            "name": "cuda_graphs",
            "status": "PASS",
        },
        {
            "time": "2026-01-01T10:05:00",
            "step": 40,
            "event": "anomaly",
            "name": "cuda_graphs",
            "kind": "loss_spike",
            "value": 9.5,
            "baseline": 3.1,
            "at_step": 39,
        },
        {
            "time": "2026-01-01T10:05:01",
            "step": 41,
            "event": "disable",
            "name": "cuda_graphs",
            "reason": "3 anomalies",
        },
        {
            "time": "2026-01-01T10:30:00",
            "step": 400,
            "event": "graduate",
            "name": "compile",
            "reason": "stable",
        },
        {"time": "2026-01-01T11:00:01", "step": 0, "event": "pretest", "name": "compile", "status": "FAIL"},
    ]
    path = events_path(tmp_path)
    path.parent.mkdir()
    path.write_text(
        "".join(json.dumps(e) + "\n" for e in events) + '{"time": "2026-01-01T10:4'
    )  # torn last line
    config = {
        "compile": True,
        "experimental_cuda_graphs": True,
        "experimental_fp8": True,
        "experimental_fa3": False,
        "experimental_blackwell_tuning": False,
        "experimental_prefetch_threads": 2,
    }
    rep = safe_opts_report(tmp_path, run, config)
    assert set(rep["requested"]) == {"compile", "cuda_graphs", "fp8", "prefetch_threads"}
    assert {n: (s["status"], s["step"]) for n, s in rep["status"].items()} == {
        "compile": ("STABLE", 400),
        "cuda_graphs": ("DISABLED", 41),
        "fp8": ("N/A", 0),
        "prefetch_threads": ("REQUESTED", None),
    }
    assert rep["status"]["fp8"]["reason"] == "no GPU"
    assert rep["anomalies"] == [
        {
            "at_step": 39,
            "kind": "loss_spike",
            "name": "cuda_graphs",
            "value": 9.5,
            "baseline": 3.1,
            "time": "2026-01-01T10:05:00",
        }
    ]
    assert len(rep["events"]) == 6


def test_help_explains_the_command(runner):
    res = invoke(runner, ["dashboard", "--help"])
    assert res.exit_code == 0, res.output
    for needle in ("CHECKPOINT_DIR", "--port", "--host", "training.db", "read"):
        assert needle in res.output, needle
