"""db_queries.py and `hydra-diag db`: hydra-train's commands re-exported, the extra queries, read-only SQL."""

from __future__ import annotations

import pytest

from .conftest import invoke, last_error_line, run_json


def test_hydra_train_db_commands_are_re_exported(runner, tiny_run):
    stats = run_json(runner, ["db", "stats", "--checkpoint_dir", tiny_run.folder])
    assert stats[0]["model_id"] == "tiny" and stats[0]["last_step"] == 16
    runs = run_json(runner, ["db", "runs", "--checkpoint_dir", tiny_run.folder])
    assert runs[0]["status"] == "finished"


def test_routing_evals_steps(runner, tiny_run):
    r = run_json(runner, ["db", "routing", "--checkpoint_dir", tiny_run.folder])
    assert r["step"] == 16
    assert [row["layer"] for row in r["mod"]] == [1] and [row["layer"] for row in r["moe"]] == [0, 1, 2]
    assert sum(r["moe"][0]["utilization"]) == pytest.approx(1.0, abs=1e-6)
    r4 = run_json(runner, ["db", "routing", "--checkpoint_dir", tiny_run.folder, "--step", 4])
    assert r4["step"] == 4 and r4["mor"]
    ev = run_json(runner, ["db", "evals", "--checkpoint_dir", tiny_run.folder])
    assert [e["step"] for e in ev["evals"]] == [0, 8, 16]
    assert ev["evals"][-1]["val_loss"] == pytest.approx(tiny_run.summary["final_val_loss"])
    st = run_json(
        runner,
        [
            "db",
            "steps",
            "--checkpoint_dir",
            tiny_run.folder,
            "--last",
            3,
            "--column",
            "loss",
            "--column",
            "lr",
        ],
    )
    assert st["columns"] == ["step", "loss", "lr"] and [r["step"] for r in st["rows"]] == [12, 14, 16]


def test_query_is_read_only(runner, tiny_run):
    out = run_json(
        runner, ["db", "query", "SELECT count(*) AS n FROM steps", "--checkpoint_dir", tiny_run.folder]
    )
    assert out["rows"] == [{"n": 8}]
    res = invoke(runner, ["db", "query", "DELETE FROM steps", "--checkpoint_dir", tiny_run.folder])
    assert res.exit_code == 1 and "SQL error" in last_error_line(res)
    again = run_json(
        runner, ["db", "query", "SELECT count(*) AS n FROM steps", "--checkpoint_dir", tiny_run.folder]
    )
    assert again["rows"] == [{"n": 8}]
    res = invoke(runner, ["db", "steps", "--checkpoint_dir", tiny_run.folder, "--column", "bogus"])
    assert res.exit_code == 1 and "bogus" in last_error_line(res)
