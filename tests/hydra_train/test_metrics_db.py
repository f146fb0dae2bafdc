"""The metrics database: schema, rows written while training, a kill mid-run, export and rebuild."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hydra_train.metrics_db import SCHEMA, TrainingDB, rebuild_database
from hydra_train.run import run_training

from .conftest import tiny_config


def test_schema_and_queries(tmp_path):
    with TrainingDB(tmp_path / "training.db") as db:
        tables = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type='table'")}
        assert set(SCHEMA) <= tables
        assert db.query("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
        db.upsert_model("tiny", "tiny", 1000, 800, {"dim": 64})
        db.start_run("r1", "tiny", 0, {"lr": 1e-3})
        losses = [8.0 - 0.5 * i for i in range(10)]
        for i, loss in enumerate(losses, 1):
            db.log_step(
                "r1",
                i,
                loss=loss,
                ema_short=loss + 0.1,
                ema_medium=loss + 0.2,
                ema_long=loss + 0.3,
                aux={"mor_router": 0.5, "bad": math.nan},
                tokens_seen=100 * i,
            )
        db.log_eval("r1", 10, 3.0)
        db.log_routing(
            "r1",
            10,
            {
                "mod": [{"layer": 1, "selected_frac": 0.75, "capacity": 0.75, "router_prob_mean": 0.5}],
                "mor": [{"layer": 0, "avg_depth": 1.5, "expected_depth": 1.6, "depth_hist": [0.0, 0.5, 0.5]}],
                "moe": [
                    {
                        "layer": 0,
                        "entropy": 1.2,
                        "utilization": [0.5, 0.5],
                        "kl_to_uniform": 0.0,
                        "max_violation": 0.1,
                    }
                ],
            },
        )
        db.finish_run("r1", "finished", best_loss=min(losses))
        st = db.stats()[0]
        assert (st["model_id"], st["logged_steps"], st["last_step"], st["best_loss"]) == ("tiny", 10, 10, 3.5)
        assert st["best_val_loss"] == 3.0
        ms = {m["threshold"]: m["step"] for m in db.milestones("tiny")}
        # ema_short at step i is 8.1 - 0.5 (i - 1): first <= 6.0 at i = 6 (5.6), first <= 4.0 at i = 10 (3.6)
        assert ms[6.0] == 6 and ms[4.0] == 10 and 3.5 not in ms
        assert [r["step"] for r in db.ema("tiny", start=8)] == [8, 9, 10]
        assert len(db.ema("tiny", limit=4)) == 4
        aux = json.loads(db.query("SELECT aux FROM steps WHERE step=1")[0]["aux"])
        assert aux == {"mor_router": 0.5, "bad": None}
        mod = db.query("SELECT * FROM routing_mod")[0]
        assert mod["compute_savings"] == pytest.approx(0.25)
        assert db.runs()[0]["status"] == "finished"


def test_training_writes_rows_and_rebuild_restores_them(bin_dataset, tmp_path):
    ck = tmp_path / "ck"
    run_training(tiny_config(bin_dataset, ck, max_steps=6, log_every=2))
    db_path = ck / "training.db"
    with TrainingDB(db_path) as db:
        steps = db.query(
            "SELECT step, loss, ema_short, ema_medium, ema_long, lr, grad_norm, tokens_per_s "
            "FROM steps ORDER BY step"
        )
        assert [r["step"] for r in steps] == [2, 4, 6]
        assert all(r[k] is not None and math.isfinite(r[k]) for r in steps for k in r)
        assert [r["step"] for r in db.query("SELECT step FROM evals ORDER BY step")] == [0, 3, 6]
        mor = db.query("SELECT * FROM routing_mor ORDER BY step, layer")
        assert mor and {r["step"] for r in mor} == {2, 4, 6}
        assert len(db.query("SELECT * FROM adaptive_lr")) == 3
        before = {t: db.query(f"SELECT * FROM {t} ORDER BY 1, 2") for t in SCHEMA if t != "models"}
        run = db.runs()[0]
    exports = list(ck.glob("diagnostics_*.json"))
    assert [p.name for p in exports] == [f"diagnostics_{run['run_id']}.json"]
    for suffix in ("", "-wal", "-shm"):
        (ck / f"training.db{suffix}").unlink(missing_ok=True)
    path, run_ids = rebuild_database(ck)
    assert run_ids == [run["run_id"]]
    with TrainingDB(path) as db:
        after = {t: db.query(f"SELECT * FROM {t} ORDER BY 1, 2") for t in SCHEMA if t != "models"}
    assert after == before


def test_a_killed_run_keeps_every_committed_row(bin_dataset, tmp_path):
    """SIGKILL a training subprocess after a few commits: every step it reported committed is in the
    database, and nothing is half-written."""
    ck = tmp_path / "ck"
    repo = Path(__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(repo)!r})\n"
        "from pathlib import Path\n"
        "from tests.hydra_train.conftest import tiny_config\n"
        "from hydra_train.run import run_training\n"
        f"cfg = tiny_config(Path({str(bin_dataset)!r}), Path({str(ck)!r}), max_steps=100000, log_every=1, "
        "eval_every=100000, save_every=0)\n"
        "run_training(cfg, announce_commits=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    committed = []
    deadline = time.time() + 240
    try:
        while len(committed) < 5 and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("[metrics_db] committed step"):
                committed.append(int(line.split()[-1]))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert len(committed) >= 5, proc.stderr.read()
    with TrainingDB(ck / "training.db") as db:
        steps = [r["step"] for r in db.query("SELECT step FROM steps ORDER BY step")]
        assert db.runs()[0]["status"] == "running"  # it never got to say otherwise
    assert steps[: len(committed)] == committed
    assert steps == list(range(1, len(steps) + 1))
