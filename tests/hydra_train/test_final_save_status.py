"""The status a run ends with when its final checkpoint's save is cut short: "interrupted" for
Ctrl-C or SIGTERM (it was "failed" for every exception there), "failed" for an error."""

from __future__ import annotations

import sqlite3

import pytest

from hydra_train.run import run_training
from hydra_train.run_guard import Terminated
from hydra_train.trainer import Trainer

from .conftest import tiny_config


@pytest.mark.parametrize(
    ("raised", "status"),
    [(KeyboardInterrupt, "interrupted"), (Terminated, "interrupted"), (OSError, "failed")],
)
def test_a_final_save_cut_short_records_why(bin_dataset, tmp_path, monkeypatch, raised, status):
    real = Trainer.save_checkpoint

    def save(self, *args, final: bool = False, **kwargs):
        if final:
            raise raised()
        return real(self, *args, final=final, **kwargs)

    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    with pytest.raises(raised):
        run_training(tiny_config(bin_dataset, tmp_path, max_steps=2))
    with sqlite3.connect(tmp_path / "training.db") as db:
        assert [r[0] for r in db.execute("SELECT status FROM runs")] == [status]
