"""knobs.py and `hydra-diag sweep knobs`: run plans, real short runs per value, the ranking and PNG."""

from __future__ import annotations

import pytest

from hydra_diag.knobs import parse_knob, plan_runs
from hydra_diag.output import DiagError

from .conftest import assert_png, invoke, last_error_line, run_json


def test_parse_and_plan():
    assert parse_knob("lr=1e-3,3e-3") == ("lr", [0.001, 0.003])
    assert parse_knob("mor_routing=token_choice") == ("mor_routing", ["token_choice"])
    with pytest.raises(DiagError):
        parse_knob("lr")
    knobs = [("lr", [1, 2]), ("mod_capacity", [0.5, 0.75, 1.0])]
    assert plan_runs(knobs, grid=False) == [
        {},
        {"lr": 1},
        {"lr": 2},
        {"mod_capacity": 0.5},
        {"mod_capacity": 0.75},
        {"mod_capacity": 1.0},
    ]
    grid = plan_runs(knobs, grid=True)
    assert len(grid) == 6 and {"lr": 2, "mod_capacity": 0.75} in grid


def test_cli_one_at_a_time(runner, tmp_path):
    png = tmp_path / "knobs.png"
    out = run_json(
        runner,
        [
            "sweep",
            "knobs",
            "--device",
            "cpu",
            "--steps",
            4,
            "--knob",
            "lr=0.001,0.01",
            "--knob",
            "mod_capacity=0.5",
            "--plot",
            png,
        ],
    )
    assert_png(png)
    assert [r["run"] for r in out["runs"]] == ["baseline", "lr=0.001", "lr=0.01", "mod_capacity=0.5"]
    assert all(r["error"] is None and r["final_val_loss"] > 0 for r in out["runs"])
    assert out["best"]["final_val_loss"] == min(r["final_val_loss"] for r in out["runs"])
    assert out["base"] == {"dim": 64, "n_mor_blocks": 3}


def test_a_run_that_fails_is_a_row_not_a_crash(runner, monkeypatch):
    # a value the config refuses (mod_capacity=1.5) is refused before any run now
    # (test_usage_checks.py); what fails in a run itself, out of memory say, stays a row
    from hydra_diag import short_runs

    real = short_runs.run_short_training

    def one_fails(**kw):
        if kw["settings"].get("mod_capacity") == 0.5:
            raise DiagError(f"{kw['label']}: out of memory")
        return real(**kw)

    monkeypatch.setattr(short_runs, "run_short_training", one_fails)
    out = run_json(runner, ["sweep", "knobs", "--device", "cpu", "--steps", 2, "--knob", "mod_capacity=0.5"])
    bad = out["runs"][1]
    assert bad["final_val_loss"] is None and "out of memory" in bad["error"]
    assert out["best"]["run"] == "baseline"


def test_unknown_knob_fails_before_training(runner):
    res = invoke(runner, ["sweep", "knobs", "--device", "cpu", "--knob", "learning_speed=1,2"])
    assert res.exit_code == 2 and "learning_speed" in last_error_line(res)
