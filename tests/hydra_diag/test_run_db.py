"""run_db.py: finding a database and a run; what a run's rows look like."""

from __future__ import annotations

import pytest

from hydra_diag.output import DiagError
from hydra_diag.run_db import db_path, load_run


def test_load_run(tiny_run):
    data = load_run(tiny_run.folder)
    assert data.run_id == tiny_run.summary["run_id"]
    assert [s["step"] for s in data.steps] == list(range(2, 17, 2))
    assert isinstance(data.steps[0]["aux"], dict) and isinstance(data.routing_moe[0]["utilization"], list)
    assert data.model_config().moe_enabled is True and data.train_config["max_steps"] == 16
    assert load_run(db_path(tiny_run.folder), run_id=data.run_id).run_id == data.run_id


def test_errors(tiny_run, tmp_path):
    with pytest.raises(DiagError, match="no metrics database"):
        db_path(tmp_path)
    with pytest.raises(DiagError, match="no run 'x'"):
        load_run(tiny_run.folder, run_id="x")
    with pytest.raises(DiagError, match="no runs of model"):
        load_run(tiny_run.folder, model="500m")
