"""The dashboard orders runs and gives a run its SafeOptimizations events by time, across an
older hydra-train's stamps (local time, no offset) and this one's (UTC with the offset), in the
runs table and in the event log alike; local time here is 9 hours ahead of UTC."""

from __future__ import annotations

import json

from .conftest import synthetic_db

ROW = dict(loss=3.0, lr=1e-3, grad_norm=1.0, ema_short=3.0, ema_medium=3.0, ema_long=3.0)


def _event(stamp: str, step: int, event: str, **more) -> str:
    return json.dumps({"time": stamp, "step": step, "event": event, **more}) + "\n"


def _old_run_resumed_by_a_new_one(folder):
    """run1: an older hydra-train's, killed (no end), started 19:00 local (10:00 UTC); run2: this
    version's, resuming it at 11:00 UTC and still running 8.5 hours later. Each logged its events
    in its own version's format."""
    from hydra_diag.dashboard.safe_events import events_path
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    synthetic_db(folder, [dict(step=s, **ROW) for s in range(1, 11)], status="running")
    with TrainingDB(folder / DB_NAME) as db:
        db.conn.execute(
            "UPDATE runs SET status='killed', started_at='2026-01-01T19:00:00.000' WHERE run_id='run1'"
        )
        db.start_run("run2", "tiny", 5, {"max_steps": 100}, resumed_from="run1")
        db.conn.execute("UPDATE runs SET started_at='2026-01-01T11:00:00.250+00:00' WHERE run_id='run2'")
        db.commit()
    log = events_path(folder)
    log.parent.mkdir()
    log.write_text(
        _event("2026-01-01T19:00:01", 0, "pretest", name="compile", status="PASS")
        + _event("2026-01-01T19:30:00", 8, "anomaly", name="compile", kind="loss_spike", at_step=8)
        + _event("2026-01-01T11:00:00+00:00", 5, "pretest", name="compile", status="FAIL")
        + _event("2026-01-01T19:30:00+00:00", 90, "anomaly", name=None, kind="grad_spike", at_step=90)
    )


def test_runs_and_their_events_are_matched_by_time(tmp_path, nine_hours_east):
    from hydra_diag.dashboard.store import DashboardStore

    _old_run_resumed_by_a_new_one(tmp_path)
    store = DashboardStore(tmp_path)
    assert [r["run_id"] for r in store.runs()] == ["run1", "run2"]  # the page opens the last one
    dead, live = (store.run(r)["safe_opts"] for r in ("run1", "run2"))
    assert [e["time"] for e in dead["events"]] == ["2026-01-01T19:00:01", "2026-01-01T19:30:00"]
    assert [a["at_step"] for a in dead["anomalies"]] == [8]
    assert dead["status"]["compile"]["status"] == "ENABLED"
    assert [a["at_step"] for a in live["anomalies"]] == [90]
    assert live["status"]["compile"]["status"] == "FAILED"
