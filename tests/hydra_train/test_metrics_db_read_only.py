"""``TrainingDB(read_only=True)`` (``hydra-train db``, hydra-diag) reads a database without writing
to it: no journal-mode switch, no schema, no -wal/-shm beside it, no file where there was none; and
still sees what a live run has committed."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from hydra_train.errors import HydraDataError
from hydra_train.metrics_db import TrainingDB, rebuild_database


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _rebuilt(folder: Path) -> Path:
    """A database as ``hydra-train db rebuild`` leaves it: rollback-journal mode, no -wal."""
    with TrainingDB(folder / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {"dim": 4})
        db.start_run("r1", "tiny", 0, {})
        db.log_step("r1", 1, loss=5.0)
        db.finish_run("r1", "finished", best_loss=5.0)
        db.export_run("r1", folder / "diagnostics_r1.json")
    path, _ = rebuild_database(folder)
    return path


def test_a_read_only_open_changes_nothing(tmp_path):
    path = _rebuilt(tmp_path)
    before = _folder_bytes(tmp_path)
    with TrainingDB(path, read_only=True) as db:
        assert [r["run_id"] for r in db.runs()] == ["r1"]
        assert db.stats()[0]["logged_steps"] == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no -wal, no -shm
    # the journal mode lives in the header: opening read-only switched a rebuilt file to WAL
    assert _folder_bytes(tmp_path) == before


def test_a_read_only_open_writes_no_schema_into_another_sqlite_file(tmp_path):
    path = tmp_path / "training.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE notes (text TEXT)")
    c.close()
    # refused by name (it read as a database with no runs: empty tables, exit 0)
    with pytest.raises(HydraDataError, match=r"not a hydra-train metrics database .*it holds notes"):
        TrainingDB(path, read_only=True)
    with sqlite3.connect(path) as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["notes"]
    c.close()


def test_hydra_train_db_commands_refuse_another_programs_database(tmp_path):
    with sqlite3.connect(tmp_path / "training.db") as c:
        c.execute("CREATE TABLE notes (text TEXT)")
    c.close()
    from typer.testing import CliRunner

    from hydra_train.cli import app

    for command in ("stats", "runs", "ema", "milestones"):
        res = CliRunner().invoke(app, ["db", command, "--checkpoint_dir", str(tmp_path)])
        assert res.exit_code == 1, (command, res.output)
        assert "not a hydra-train metrics database" in res.output and "Traceback" not in res.output


def test_a_read_only_open_of_a_missing_file_creates_nothing(tmp_path):
    with pytest.raises(HydraDataError, match="no metrics database"):
        TrainingDB(tmp_path / "sub" / "training.db", read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_a_live_run_is_read_while_it_writes(tmp_path):
    """The dashboard's case: the writer holds the database open in WAL mode; a read-only open sees
    every committed row, the uncommitted ones not, and does not hold the writer up."""
    writer = TrainingDB(tmp_path / "training.db")
    try:
        writer.upsert_model("tiny", "tiny", 10, 8, {})
        writer.start_run("r1", "tiny", 0, {})
        for step in (1, 2):
            writer.log_step("r1", step, loss=5.0)
        writer.commit()
        writer.log_step("r1", 3, loss=4.0)  # not committed yet
        with TrainingDB(tmp_path / "training.db", read_only=True) as db:
            assert [r["step"] for r in db.query("SELECT step FROM steps ORDER BY step")] == [1, 2]
            writer.commit()  # a reader's open snapshot does not block the writer
        with TrainingDB(tmp_path / "training.db", read_only=True) as db:
            assert db.query("SELECT max(step) AS s FROM steps")[0]["s"] == 3
    finally:
        writer.close()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through modes")
@pytest.mark.parametrize("rebuilt", [True, False], ids=["rollback-journal", "wal"])
def test_a_write_protected_copy_is_read(tmp_path, rebuilt):
    """A colleague's run copied read-only (chmod -w on the file and its folder): SQLite can create
    no -wal or -shm there, which the WAL switch and a WAL database's plain open both need."""
    folder = tmp_path / "copy"
    folder.mkdir()
    if rebuilt:
        path = _rebuilt(folder)
    else:
        with TrainingDB(folder / "training.db") as db:
            db.upsert_model("tiny", "tiny", 10, 8, {})
            db.start_run("r1", "tiny", 0, {})
        path = folder / "training.db"
    for p in folder.iterdir():
        p.chmod(0o444)
    folder.chmod(0o555)
    try:
        with TrainingDB(path, read_only=True) as db:
            assert [r["run_id"] for r in db.runs()] == ["r1"]
    finally:
        folder.chmod(0o755)
