"""The metrics database across resumes: the rows a dead run logged after the checkpoint being
resumed go (in every step-keyed table, and again in a rebuild from the JSON exports), and only
those: other runs of the model keep theirs."""

from __future__ import annotations

import sqlite3
import time

import pytest

from hydra_train.metrics_db import _PER_RUN_TABLES, TrainingDB, rebuild_database
from hydra_train.run import run_training

from .conftest import TINY_OVERRIDES, tiny_config
from .test_trainer import CrashAt

#: MoE and a third block (the middle one routed by MoD), so that every routing table gets rows
ROUTED = {**TINY_OVERRIDES, "moe_enabled": True, "n_mor_blocks": 3}


def _steps_by_run(folder) -> list[tuple[str, list[int]]]:
    """(status, logged steps) of each run, in the order they started."""
    with sqlite3.connect(folder / "training.db") as c:
        runs = c.execute("SELECT run_id, status FROM runs ORDER BY started_at").fetchall()
        return [
            (status, [s for (s,) in c.execute("SELECT step FROM steps WHERE run_id=? ORDER BY step", (rid,))])
            for rid, status in runs
        ]


def _logged_twice(folder) -> dict[str, list]:
    """Per step-keyed table, the (step[, layer]) keys that more than one run logged."""
    out = {}
    with sqlite3.connect(folder / "training.db") as c:
        for table in _PER_RUN_TABLES:
            key = "step, layer" if table.startswith("routing_") else "step"
            out[table] = c.execute(
                f"SELECT {key}, count(*) FROM {table} GROUP BY {key} HAVING count(*) > 1"
            ).fetchall()
    return out


def _crash_and_resume(bin_dataset, folder):
    cfg = tiny_config(bin_dataset, folder, max_steps=8, save_every=4, log_every=1, model_overrides=ROUTED)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, callbacks=[CrashAt(6)])
    run_training(cfg.replace(resume=True))


def test_a_resume_drops_only_the_rows_of_the_run_it_continues(bin_dataset, tmp_path):
    cfg = tiny_config(bin_dataset, tmp_path, max_steps=8, save_every=4, log_every=1)
    run_training(cfg)  # an earlier run of the same model in this folder, finished
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, callbacks=[CrashAt(6)])  # checkpoint at 4, rows to 6
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg.replace(resume=True), callbacks=[CrashAt(6)])  # from 4 again, no checkpoint
    assert _steps_by_run(tmp_path)[2][1] == [5]  # (the crash comes before step 6 is logged)
    run_training(cfg.replace(resume=True))  # from the first crashed run's step 4 once more
    assert _steps_by_run(tmp_path) == [
        ("finished", [1, 2, 3, 4, 5, 6, 7, 8]),  # not this lineage's: untouched
        ("failed", [1, 2, 3, 4]),
        ("failed", []),  # continued the same checkpoint: its step 5 is superseded too
        ("finished", [5, 6, 7, 8]),
    ]


def test_a_resume_leaves_no_step_logged_twice_in_any_table(bin_dataset, tmp_path):
    _crash_and_resume(bin_dataset, tmp_path)
    assert _logged_twice(tmp_path) == {t: [] for t in _PER_RUN_TABLES}
    with sqlite3.connect(tmp_path / "training.db") as c:  # each table had rows to duplicate
        for table in _PER_RUN_TABLES:
            assert c.execute(f"SELECT count(DISTINCT run_id) FROM {table}").fetchone()[0] == 2, table


def test_a_rebuild_does_not_bring_superseded_rows_back(bin_dataset, tmp_path):
    _crash_and_resume(bin_dataset, tmp_path)
    before = _steps_by_run(tmp_path)
    rebuild_database(tmp_path)  # the crashed run's export still holds its step 5
    assert _steps_by_run(tmp_path) == before == [("failed", [1, 2, 3, 4]), ("finished", [5, 6, 7, 8])]
    assert _logged_twice(tmp_path) == {t: [] for t in _PER_RUN_TABLES}


def test_a_rebuild_drops_rows_only_of_runs_started_before_each_resume(tmp_path):
    # a -> b (resumed at 4) -> c (resumed b's checkpoint at 8): b's steps 5..8 stay
    with TrainingDB(tmp_path / "training.db") as db:
        for rid, start, parent, steps in (
            ("a", 0, None, range(1, 7)),
            ("b", 4, "a", range(5, 11)),
            ("c", 8, "b", range(9, 13)),
        ):
            db.start_run(rid, "tiny", start, {}, resumed_from=parent)
            for s in steps:
                db.log_step(rid, s, loss=1.0)
            db.export_run(rid, tmp_path / f"diagnostics_{rid}.json")
            time.sleep(0.01)  # started_at has millisecond resolution
        live = db.query("SELECT run_id, step FROM steps ORDER BY step")
    rebuild_database(tmp_path)
    with TrainingDB(tmp_path / "training.db") as db:
        assert db.query("SELECT run_id, step FROM steps ORDER BY step") == live
    assert [r["run_id"] for r in live] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
