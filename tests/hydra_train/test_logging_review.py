"""Review of what a run reports besides training: loggers that fail, callbacks that raise at the
end, non-finite numbers in the summary JSON, and the summary's tokens/s against the database."""

from __future__ import annotations

import dataclasses
import errno
import json
import random
import sqlite3
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training
from hydra_train.summary import summary_rows

from .conftest import tiny_config
from .test_trainer import CrashAt


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (what jq and every other parser refuse)."""

    def refuse(const):
        raise ValueError(f"non-standard JSON constant {const}")

    return json.loads(text, parse_constant=refuse)


def db_rows(folder: Path, sql: str, params=()) -> list[tuple]:
    with sqlite3.connect(folder / "training.db") as c:
        return c.execute(sql, params).fetchall()


# -- a logger whose backend fails mid-run ----------------------------------------------------------


class FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's surface; add_scalar fails from ``fail_at`` on."""

    instances: ClassVar[list[FakeWriter]] = []
    fail_at: int | None = None

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        FakeWriter.instances.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.fail_at is not None and step >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device", self.log_dir + "/events.out")
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    mod = types.ModuleType("torch.utils.tensorboard")
    mod.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", mod)
    FakeWriter.instances = []
    FakeWriter.fail_at = None
    yield FakeWriter


def test_a_tensorboard_failure_mid_run_is_reported_and_the_run_goes_on(
    bin_dataset, tmp_path, fake_tensorboard, capsys
):
    max_steps = 6
    fail_at = random.randint(2, max_steps - 1)
    fake_tensorboard.fail_at = fail_at
    ck = tmp_path / "ck"
    summary = run_training(
        tiny_config(bin_dataset, ck, max_steps=max_steps, log_every=1, eval_every=100, tensorboard=True)
    )
    assert summary["status"] == "finished" and Path(summary["final_checkpoint"]).is_file()
    (writer,) = fake_tensorboard.instances
    assert Path(writer.log_dir) == Path(summary["run_dir"]) / "tensorboard"
    # every step is in the database; the writer got those before the failure, and nothing after
    steps = db_rows(ck, "SELECT step, loss FROM steps ORDER BY step")
    assert [s for s, _ in steps] == list(range(1, max_steps + 1))
    logged = {step: v for tag, v, step in writer.scalars if tag == "train/loss"}
    assert logged == pytest.approx({s: loss for s, loss in steps if s < fail_at})
    # said when it happened, counted in the summary (its table and its JSON)
    err = capsys.readouterr().err
    assert "tensorboard" in err and f"step {fail_at}" in err and "No space left" in err
    assert f"step {fail_at}" in summary["logger_errors"]["tensorboard"]
    rows = dict(summary_rows(summary))
    assert "tensorboard" in rows["loggers"] and f"step {fail_at}" in rows["loggers"]
    assert writer.closed


def test_a_healthy_tensorboard_logger_reports_no_error(bin_dataset, tmp_path, fake_tensorboard):
    summary = run_training(tiny_config(bin_dataset, tmp_path / "ck", max_steps=4, tensorboard=True))
    (writer,) = fake_tensorboard.instances
    logged = sorted({step for tag, _, step in writer.scalars if tag == "train/loss"})
    assert logged == [s for (s,) in db_rows(tmp_path / "ck", "SELECT step FROM steps ORDER BY step")]
    assert not summary.get("logger_errors") and "loggers" not in dict(summary_rows(summary))


def test_wandb_init_failure_is_one_clear_error(bin_dataset, tmp_path, monkeypatch):
    from hydra_train.errors import HydraTrainError
    from hydra_train.loggers import WandbCallback

    calls = []

    def init(**kw):
        calls.append(kw)
        raise RuntimeError("network unreachable")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(HydraTrainError, match=r"--wandb.*network unreachable.*WANDB_MODE"):
        WandbCallback(str(tmp_path), "r1", {})
    assert calls[0]["mode"] == "offline" and calls[0]["dir"] == str(tmp_path)


# -- a callback raising in on_train_end -------------------------------------------------------------


class RaisesAtEnd(TrainerCallback):
    name = "raises_at_end"

    def on_train_end(self, summary):
        raise RuntimeError("user callback broke at the end")


def test_a_callback_raising_at_the_end_leaves_the_others_their_on_train_end(bin_dataset, tmp_path):
    ck = tmp_path / "ck"
    cfg = tiny_config(bin_dataset, ck, max_steps=4, summary_dir=str(tmp_path / "s"))
    with pytest.raises(RuntimeError, match="user callback broke at the end"):
        run_training(cfg, callbacks=[RaisesAtEnd()])
    # the metrics database's callback ran after it: the run is closed and exported
    ((run_id, status, end_step),) = db_rows(ck, "SELECT run_id, status, end_step FROM runs")
    assert (status, end_step) == ("finished", 4)
    export = json.loads((ck / f"diagnostics_{run_id}.json").read_text())
    assert export["run"]["status"] == "finished"
    assert [r["step"] for r in export["steps"]] == [s for (s,) in db_rows(ck, "SELECT step FROM steps")]
    # and run.py still writes the --summary_dir file after the raise (it was skipped)
    (written,) = (tmp_path / "s").glob("train_summary_*.json")
    doc = json.loads(written.read_text())
    assert (doc["run_id"], doc["status"], doc["steps"]) == (run_id, "finished", 4)


def test_callback_list_calls_every_on_train_end_and_raises_the_first_error():
    from hydra_train.callbacks import CallbackList

    seen = []

    class Ok(TrainerCallback):
        def __init__(self, name):
            self.name = name

        def on_train_end(self, summary):
            seen.append(self.name)

    class Bad(TrainerCallback):
        def __init__(self, name):
            self.name = name

        def on_train_end(self, summary):
            seen.append(self.name)
            raise ValueError(self.name)

    names = [f"cb{i}" for i in range(6)]
    bad = set(random.sample(names, 2))
    cbs = CallbackList([Bad(n) if n in bad else Ok(n) for n in names])
    with pytest.raises(ValueError) as info:
        cbs.call("on_train_end", {})
    assert seen == names
    assert str(info.value) == min(bad, key=names.index)


# -- non-finite numbers in the summary ----------------------------------------------------------------


class NanLossAt(TrainerCallback):
    """Make the step ``at`` report a non-finite loss (a skipped step), as a diverging batch does."""

    name = "nan_loss_at"

    def __init__(self, at: int):
        self.at = at

    def on_train_start(self, trainer):
        inner = trainer.step_impl

        def step_impl(batches):
            res = inner(batches)
            if trainer.step + 1 == self.at:
                nan = torch.full_like(res.loss, float("nan"))
                res = dataclasses.replace(res, loss=nan, ce_loss=nan, finite=torch.zeros_like(res.finite))
            return res

        trainer.step_impl = step_impl


def test_the_summary_json_stays_valid_when_the_last_loss_is_not_finite(bin_dataset, tmp_path):
    max_steps = random.randint(3, 5)
    ck, out = tmp_path / "ck", tmp_path / "s"
    summary = run_training(
        tiny_config(bin_dataset, ck, max_steps=max_steps, log_every=1, summary_dir=str(out)),
        callbacks=[NanLossAt(max_steps)],
    )
    (path,) = out.glob("train_summary_*.json")
    written = strict_json(path.read_text())
    # the database's own record of the last step: no loss (NULL)
    ((last_loss,),) = db_rows(ck, "SELECT loss FROM steps WHERE step=?", (max_steps,))
    assert last_loss is None
    assert written["final_loss"] is None and summary["final_loss"] is None
    ((best,),) = db_rows(ck, "SELECT min(loss) FROM steps")
    assert written["best_loss"] == pytest.approx(best)
    strict_json(json.dumps(summary))


# -- tokens/s against the database -------------------------------------------------------------------


def test_summary_tokens_per_s_of_a_failed_run_matches_its_logged_rows(bin_dataset, tmp_path):
    log_every = random.randint(2, 3)
    crash = log_every * 2 + random.randint(1, log_every - 1)  # after the second log, before a third
    ck = tmp_path / "ck"
    cfg = tiny_config(bin_dataset, ck, max_steps=20, log_every=log_every, eval_every=100, save_every=0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, callbacks=[CrashAt(crash)])
    ((status, tps),) = db_rows(ck, "SELECT status, tokens_per_s FROM runs")
    rows = db_rows(ck, "SELECT tokens_seen, tokens_per_s FROM steps ORDER BY step")
    assert status == "failed" and len(rows) == 2
    # each row covers the tokens since the previous row, at its rate: total tokens / total time
    seen = [r[0] for r in rows]
    tokens = [b - a for a, b in zip([0, *seen[:-1]], seen, strict=True)]
    seconds = sum(t / r[1] for t, r in zip(tokens, rows, strict=True))
    assert tps == pytest.approx(sum(tokens) / seconds, rel=1e-9)


# -- db rebuild with an export it cannot read ---------------------------------------------------------


def _write_runs(folder: Path, n: int) -> list[str]:
    from hydra_train.metrics_db import TrainingDB

    ids = [f"tiny_r{i}_{random.randrange(10**6)}" for i in range(n)]
    with TrainingDB(folder / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {"dim": 8})
        for rid in ids:
            db.start_run(rid, "tiny", 0, {})
            for step in range(1, random.randint(2, 6)):
                db.log_step(rid, step, loss=random.random() * 5, tokens_seen=step * 64)
            db.finish_run(rid, "finished")
            db.export_run(rid, folder / f"diagnostics_{rid}.json")
    return ids


BAD_EXPORTS = [
    '{"format": "hydra-train-diag',  # cut short
    "[1, 2]",  # JSON, not an export
    b"\xff\xfe\x00garbage",  # not text
    '{"format": "hydra-train-diagnostics", "run": {"run_id": "x", "no_such_column": 1}}',  # damaged
]


@pytest.mark.parametrize("bad", BAD_EXPORTS)
def test_db_rebuild_names_an_unreadable_export_and_leaves_nothing_behind(tmp_path, bad):
    from typer.testing import CliRunner

    from hydra_train.cli import app

    _write_runs(tmp_path, 2)
    before = db_rows(tmp_path, "SELECT run_id, step, loss FROM steps ORDER BY run_id, step")
    broken = tmp_path / "diagnostics_zz_broken.json"
    if isinstance(bad, bytes):
        broken.write_bytes(bad)
    else:
        broken.write_text(bad)
    r = CliRunner().invoke(app, ["db", "rebuild", "--checkpoint_dir", str(tmp_path)])
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and broken.name in lines[0] and "move it away" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".training.db")) == []
    assert db_rows(tmp_path, "SELECT run_id, step, loss FROM steps ORDER BY run_id, step") == before


# -- hydra-train pretest --json with a non-finite arm ---------------------------------------------------


def test_pretest_json_is_valid_when_an_arm_goes_non_finite(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from hydra_train.cli import app

    from .test_cli_pretest import TINY

    monkeypatch.setenv("HYDRA_SAFEOPTS_INJECT", "nan_grad:static_routing@pretest")
    args = ["pretest", *TINY, "--static-routing-mode", "--only", "static_routing"]
    r = CliRunner().invoke(app, [*args, "--log_dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rec = strict_json(r.stdout)
    arm = rec["results"]["static_routing"]["arm"]
    # the steps that were not finite have no gradient norm (null), the others theirs
    assert [g is None for g in arm["grad_norms"]] == [not f for f in arm["finite"]]
    assert not all(arm["finite"])
    r = CliRunner().invoke(app, ["pretest", "--history", "--log_dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    strict_json(r.stdout)


# -- db commands with a --model the database does not have ----------------------------------------------


@pytest.mark.parametrize("command", ["stats", "runs", "ema", "milestones"])
def test_db_commands_refuse_a_model_the_database_does_not_have(tmp_path, command):
    from typer.testing import CliRunner

    from hydra_train.cli import app

    _write_runs(tmp_path, 1)
    ((known,),) = db_rows(tmp_path, "SELECT model_id FROM models")
    wrong = known + random.choice(["x", "_100m", "0"])
    args = ["db", command, "--checkpoint_dir", str(tmp_path), "--json"]
    r = CliRunner().invoke(app, [*args, "--model", wrong])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert r.stdout == "" and wrong in r.stderr and known in r.stderr
    r = CliRunner().invoke(app, [*args, "--model", known])
    assert r.exit_code == 0 and isinstance(strict_json(r.stdout), list)
