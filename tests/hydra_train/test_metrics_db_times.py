"""The runs table's times: written in UTC with an offset; rows of older versions (local time, no
offset) still order and compare with them; ``hydra-train db runs`` shows both."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.metrics_db import TrainingDB


def _utc(stamp: str) -> datetime:
    t = datetime.fromisoformat(stamp)
    assert t.utcoffset() == timedelta(0), f"{stamp!r} is not UTC with an offset"
    return t


def test_run_and_model_times_are_utc_with_an_offset(tmp_path, nine_hours_east):
    before = datetime.now(timezone.utc)
    with TrainingDB(tmp_path / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {})
        db.start_run("r1", "tiny", 0, {})
        db.finish_run("r1", "finished")
        run = db.query("SELECT started_at, ended_at FROM runs")[0]
        created = db.query("SELECT created_at FROM models")[0]["created_at"]
    after = datetime.now(timezone.utc)
    for stamp in (run["started_at"], run["ended_at"], created):
        assert before - timedelta(seconds=1) <= _utc(stamp) <= after + timedelta(seconds=1)


def _old_run(db: TrainingDB, run_id: str, local: datetime, steps: range, resumed_from=None) -> None:
    """A run as an older hydra-train recorded it: ``started_at`` in local time, no offset (its rows
    written as they were, without the drop a resume makes)."""
    db.start_run(run_id, "tiny", 0, {}, resumed_from=resumed_from)
    stamp = local.isoformat(timespec="milliseconds")
    db.conn.execute("UPDATE runs SET started_at=? WHERE run_id=?", (stamp, run_id))
    for s in steps:
        db.log_step(run_id, s, loss=5.0)
    db.commit()


def test_old_local_rows_order_and_compare_with_new_utc_rows(tmp_path, nine_hours_east):
    """Two old runs (``b`` continued ``a``) started an hour and half an hour ago, in local time 9
    hours ahead of UTC: their stamps read later than a UTC stamp of now. A new run resuming ``b``
    still counts ``a`` as started before it (its lineage) and drops both runs' rows after its
    checkpoint; the runs list still has the new run last (hydra-diag's "most recent run")."""
    now = datetime.now()
    with TrainingDB(tmp_path / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {})
        _old_run(db, "a", now - timedelta(hours=1), range(1, 11))
        _old_run(db, "b", now - timedelta(minutes=30), range(9, 13), resumed_from="a")
        db.start_run("new", "tiny", 6, {}, resumed_from="b")
        steps = {r: [x["step"] for x in db.query("SELECT step FROM steps WHERE run_id=?", [r])] for r in "ab"}
        assert steps == {"a": [1, 2, 3, 4, 5, 6], "b": []}
        assert [r["run_id"] for r in db.runs()] == ["a", "b", "new"]
        started_b = db.runs()[1]["started_at"]
        # an old stamp as ``before``: "new" started after "b", so its link to "b" does not count
        assert db.lineage("new", before=started_b) == {"new"}
        # a step two runs logged (another lineage): the later run's row is the last one
        _old_run(db, "other", now - timedelta(hours=2), range(20, 21))
        db.log_step("new", 20, loss=1.0)
        assert db.stats("tiny")[0]["last_loss"] == 1.0
        assert [r["run_id"] for r in db.ema("tiny", start=20)] == ["other", "new"]


def test_db_runs_shows_when_runs_started_and_ended(tmp_path, nine_hours_east):
    local = datetime(2026, 1, 2, 19, 0, 0)
    with TrainingDB(tmp_path / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {})
        _old_run(db, "old", local, range(1, 3))
        db.start_run("new", "tiny", 0, {})
        db.conn.execute(
            "UPDATE runs SET started_at='2026-01-03T10:00:00.000+00:00', "
            "ended_at='2026-01-03T11:30:00.250+00:00' WHERE run_id='new'"
        )
    runner = CliRunner()
    res = runner.invoke(app, ["db", "runs", "--checkpoint_dir", str(tmp_path)], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "2026-01-03 10:00 UTC" in res.output and "2026-01-03 11:30 UTC" in res.output
    # an old row's stamp has no zone: shown as written, marked as the writer's local time
    assert "2026-01-02 19:00 local" in res.output
    res = runner.invoke(app, ["db", "runs", "--checkpoint_dir", str(tmp_path), "--json"])
    rows = {r["run_id"]: r for r in json.loads(res.output)}
    assert rows["new"]["started_at"] == "2026-01-03T10:00:00.000+00:00"  # --json: as stored
    assert rows["old"]["started_at"] == "2026-01-02T19:00:00.000"
