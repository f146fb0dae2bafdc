"""What a command writes and what it reads, where a new user's probe found it wrong: --plot paths
(checked first, reported as written), a routing step that was not logged, another program's
SQLite file, and the folder a failed conversion created."""

from __future__ import annotations

import json
import sqlite3

import pytest

from .conftest import invoke, one_line_error, run_json, synthetic_db
from .test_learning import _planted_rows


@pytest.fixture
def run_folder(tmp_path):
    return synthetic_db(tmp_path / "ck", _planted_rows())


def test_a_plot_format_matplotlib_cannot_write_is_refused_first(runner, run_folder, tmp_path):
    # it was matplotlib's ValueError traceback after the analysis, and --json lost the result
    res = invoke(
        runner,
        ["analyze", "learning", "--checkpoint_dir", run_folder, "--plot", tmp_path / "p.xyz", "--json"],
    )
    assert res.exit_code == 2 and res.stdout == "", res.output
    line = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(line) == 1 and ".xyz" in line[0] and ".png" in line[0], res.stderr


def test_a_plot_name_without_extension_reports_the_file_written(runner, run_folder, tmp_path):
    out = run_json(
        runner, ["analyze", "learning", "--checkpoint_dir", run_folder, "--plot", tmp_path / "myplot"]
    )
    assert out["plot"] == str(tmp_path / "myplot.png") and (tmp_path / "myplot.png").is_file()
    res = invoke(
        runner, ["analyze", "learning", "--checkpoint_dir", run_folder, "--plot", tmp_path / "myplot"]
    )
    assert f"plot: {tmp_path / 'myplot.png'}" in res.stdout.splitlines()  # one line, not wrapped


def test_a_folder_is_no_plot_path(runner, run_folder, tmp_path):
    folder = tmp_path / "plots"
    folder.mkdir()
    res = invoke(runner, ["analyze", "learning", "--checkpoint_dir", run_folder, "--plot", folder])
    assert res.exit_code == 2 and "is a folder" in res.stderr, res.output
    assert not (tmp_path / "plots.png").exists()


def _moe_row(step: int) -> dict:
    util = [0.25] * 4
    return {"step": step, "layer": 0, "utilization": util, "entropy": 1.386, "kl_to_uniform": 0.0}


def test_db_routing_at_a_step_that_was_not_logged(runner, tmp_path):
    rows = [{"step": s, "loss": 3.0, "ce_loss": 3.0, "aux_loss": 0.0, "aux": {}, "lr": 1e-3} for s in (4, 8)]
    folder = synthetic_db(tmp_path, rows, moe_rows=[_moe_row(4), _moe_row(8)])
    assert run_json(runner, ["db", "routing", "--checkpoint_dir", folder, "--step", 8])["step"] == 8
    res = invoke(runner, ["db", "routing", "--checkpoint_dir", folder, "--step", 999])
    one_line_error(res, "no routing rows at step 999; logged steps: 4, 8")
    assert res.stdout == ""  # not a header with empty lists


def test_a_long_list_of_logged_steps_is_shortened():
    from hydra_diag.db_queries import step_list

    assert step_list([4, 8, 12, 16]) == "4, 8, 12, 16"
    assert step_list(list(range(1, 101))) == "1, 2, 3, 4, 5, 6, ... (88 more), 95, 96, 97, 98, 99, 100"


@pytest.fixture
def foreign_db(tmp_path):
    """Another program's SQLite database, as a checkpoint folder's training.db and as a file."""
    folder = tmp_path / "f"
    folder.mkdir()
    conn = sqlite3.connect(folder / "training.db")
    conn.execute("CREATE TABLE foo (x)")
    conn.commit()
    conn.close()
    return folder


def test_dashboard_names_a_foreign_database_as_such(runner, foreign_db):
    # it said "older schema ...: rebuild it with hydra-train db rebuild", which cannot help
    res = invoke(runner, ["dashboard", foreign_db / "training.db"])
    one_line_error(res, "is not a hydra-train metrics database", "foo")
    assert "rebuild" not in res.stderr


def test_dashboard_on_a_text_file_names_training_db(runner, tmp_path):
    (tmp_path / "notack.pt").write_text("not a database\n")
    res = invoke(runner, ["dashboard", tmp_path / "notack.pt"])
    one_line_error(res, "is not an SQLite database", "pass the training.db a hydra-train run wrote")


@pytest.mark.parametrize("command", ["stats", "runs", "milestones", "steps", "evals", "routing"])
def test_db_commands_agree_on_a_foreign_database(runner, foreign_db, command):
    # stats and runs printed empty tables, exit 0, while steps said "holds no runs", exit 1
    res = invoke(runner, ["db", command, "--checkpoint_dir", foreign_db])
    one_line_error(res, "is not a hydra-train metrics database")


def test_hydra_train_db_commands_still_read_a_real_database(runner, run_folder):
    rows = run_json(runner, ["db", "runs", "--checkpoint_dir", run_folder])
    assert [r["run_id"] for r in rows] == ["run1"]


def test_a_failed_conversion_removes_the_folder_it_created(runner, tmp_path):
    from hydra_train.tokenizer import train_bpe

    tok = tmp_path / "tok.json"
    tok.write_text(train_bpe(["alpha beta gamma delta"] * 20, 300).to_str())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "new" / "shards"
    res = invoke(runner, ["convert", "jsonl-to-pt", empty, "--out", out, "--tokenizer", tok])
    assert res.exit_code == 1 and "no tokens were written" in res.stderr, res.output
    assert not (tmp_path / "new").exists()  # the help promises OUT_DIR "as it was": absent
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text(json.dumps({"mine": True}))
    res = invoke(runner, ["convert", "jsonl-to-pt", empty, "--out", kept / "sub", "--tokenizer", tok])
    assert res.exit_code == 1 and sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
