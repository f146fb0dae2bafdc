"""A resume whose --max_steps the checkpoint has already reached trains nothing: it must not run
the pretests nor add a run row to training.db (each such call added an empty "finished" run).
(run_start.nothing_to_train)."""

from __future__ import annotations

import sqlite3

from hydra_train.run import run_training
from hydra_train.safe_opts.callback import SafeOptimizations

from .conftest import tiny_config


def test_resume_at_or_past_max_steps_records_nothing(bin_dataset, tmp_path, monkeypatch):
    cfg = tiny_config(bin_dataset, tmp_path, max_steps=2, save_every=2, eval_every=2)
    run_training(cfg)
    applied: list[int] = []
    real_apply = SafeOptimizations.apply

    def counting_apply(self, trainer):
        applied.append(trainer.step)
        return real_apply(self, trainer)

    monkeypatch.setattr(SafeOptimizations, "apply", counting_apply)
    for max_steps in (2, 1):
        summaries = tmp_path / f"summaries{max_steps}"
        summary = run_training(cfg.replace(resume=True, max_steps=max_steps, summary_dir=str(summaries)))
        assert summary["steps"] == 2
        assert len(list(summaries.glob("train_summary_*.json"))) == 1  # --summary_dir still written
    with sqlite3.connect(tmp_path / "training.db") as c:
        runs = c.execute("SELECT status, start_step, end_step FROM runs").fetchall()
    assert runs == [("finished", 0, 2)], runs  # the first run's row alone
    assert applied == []  # no pretests for a run that trains nothing
