"""Ctrl-C (SIGINT) or SIGTERM during training saves a checkpoint at the next step boundary, then
the run ends as an interrupted run did before (status "interrupted", exit 130/143, the hint now
pointing at the saved checkpoint). Every step since the last ``--save_every`` checkpoint was lost.
A second signal during the drain quits at once (no partial file left); a duplicate SIGTERM (a
cluster signals each process of a job and torchrun forwards its own) does not. Each signal is sent
by the process to itself from a callback, in-process.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hydra_train.run as run_mod
from hydra_train.callbacks import TrainerCallback
from hydra_train.checkpoint import list_checkpoints, load_checkpoint
from hydra_train.cli import app
from hydra_train.run import run_training
from hydra_train.run_guard import Terminated

from .conftest import TINY_OVERRIDES, VOCAB, tiny_config
from .test_trainer import Recorder

STOP_LINE = "stopping after this step and saving a checkpoint; Ctrl-C again to quit at once"


class SignalAt(TrainerCallback):
    """Send ``signals`` to this process, one after the other, when step ``step`` ends."""

    name = "signal_at"

    def __init__(self, step: int, *signals: int) -> None:
        self.step, self.signals = step, signals or (signal.SIGINT,)

    def on_step_end(self, step, metrics) -> None:
        if step == self.step:
            for s in self.signals:
                os.kill(os.getpid(), s)


def _statuses(ckpt: Path) -> list[str]:
    with sqlite3.connect(ckpt / "training.db") as c:
        return [r[0] for r in c.execute("SELECT status FROM runs ORDER BY started_at")]


def _names(ckpt: Path) -> list[str]:
    return sorted(p.name for p in list_checkpoints(ckpt))


def _handlers() -> tuple:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_ctrl_c_saves_the_step_and_the_resume_equals_the_uninterrupted_run(bin_dataset, tmp_path, capfd):
    def cfg(folder: str, **kw):
        return tiny_config(bin_dataset, tmp_path / folder, max_steps=8, save_every=4, **kw)

    full = Recorder()
    run_training(cfg("a"), callbacks=[full])
    before = _handlers()
    first = Recorder()
    with pytest.raises(KeyboardInterrupt) as info:
        run_training(cfg("b"), callbacks=[first, SignalAt(5)])
    assert type(info.value) is KeyboardInterrupt
    assert _handlers() == before  # the run's handlers are gone
    assert STOP_LINE in capfd.readouterr().err
    # step 5 saved (the step-4 checkpoint alone was there), a valid file
    assert _names(tmp_path / "b") == ["hydra_tiny_step4.pt", "hydra_tiny_step5.pt"]
    ck = load_checkpoint(tmp_path / "b" / "hydra_tiny_step5.pt")
    assert ck["step"] == 5 and ck["data"]["position"] == 5
    assert sorted(first.losses) == [1, 2, 3, 4, 5]
    assert _statuses(tmp_path / "b") == ["interrupted"]

    second = Recorder()
    s = run_training(cfg("b", resume=True), callbacks=[second])
    assert s["status"] == "finished" and s["steps"] == 8
    assert sorted(second.losses) == [6, 7, 8]
    for step in range(6, 9):
        assert second.losses[step] == full.losses[step], step  # bitwise
    a = torch.load(tmp_path / "a" / "hydra_tiny_final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "hydra_tiny_final.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # no evaluation of its own at the interrupted step: the same validation history (steps, values)
    assert a["trainer"]["val_history"] == b["trainer"]["val_history"]
    assert _statuses(tmp_path / "b") == ["interrupted", "finished"]


def test_sigterm_delivered_twice_saves_once_and_ends_terminated(bin_dataset, tmp_path):
    ckpt = tmp_path / "ck"
    # torchrun forwards the SIGTERM a cluster also sends to every process of the job: one request
    with pytest.raises(Terminated):
        run_training(
            tiny_config(bin_dataset, ckpt, max_steps=8, save_every=0),
            callbacks=[SignalAt(3, signal.SIGTERM, signal.SIGTERM)],
        )
    assert _names(ckpt) == ["hydra_tiny_step3.pt"]
    assert load_checkpoint(ckpt / "hydra_tiny_step3.pt")["step"] == 3
    assert _statuses(ckpt) == ["interrupted"]


def test_a_second_ctrl_c_during_the_save_quits_at_once_leaving_no_partial_file(
    bin_dataset, tmp_path, monkeypatch
):
    ckpt = tmp_path / "ck"
    real, attempts = torch.save, []

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("step") == 5:  # the interrupt's save: cut short
            attempts.append(5)
            f.write(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGINT)
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    before = _handlers()
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_config(bin_dataset, ckpt, max_steps=8, save_every=4), callbacks=[SignalAt(5)])
    assert attempts == [5], "the interrupt did not try to save step 5"
    assert _handlers() == before
    # the cut save left neither a checkpoint of step 5 nor its temporary file
    assert _names(ckpt) == ["hydra_tiny_step4.pt"]
    assert not list(ckpt.glob("*.tmp")) and not list(ckpt.glob(".*.tmp"))
    assert _statuses(ckpt) == ["interrupted"]
    monkeypatch.setattr(torch, "save", real)
    s = run_training(tiny_config(bin_dataset, ckpt, max_steps=8, save_every=4, resume=True))
    assert s["steps"] == 8 and s["status"] == "finished"


class SignalAtEval(TrainerCallback):
    name = "signal_at_eval"

    def on_eval(self, step, val_loss) -> None:
        if step == 0:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_during_the_first_evaluation_quits_at_once(bin_dataset, tmp_path):
    """Before the loop there is no step to save: today's behaviour, at once."""
    ckpt = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_config(bin_dataset, ckpt, max_steps=8, save_every=4), callbacks=[SignalAtEval()])
    assert _names(ckpt) == []
    assert _statuses(ckpt) == ["interrupted"]


def test_the_cli_exits_130_and_hints_resume_from_the_saved_step(bin_dataset, tmp_path, monkeypatch):
    ckpt = tmp_path / "r2"
    real = run_mod.run_training
    monkeypatch.setattr(run_mod, "run_training", lambda cfg, **kw: real(cfg, callbacks=[SignalAt(15)], **kw))
    args = ["run", "--dataset", str(bin_dataset), "--vocab_size", str(VOCAB), "--seq_len", "32"]
    args += ["--batch_size", "2", "--max_steps", "60", "--save_every", "10", "--log_every", "5"]
    args += ["--eval_every", "100", "--eval_batches", "1", "--checkpoint_dir", str(ckpt)]
    args += ["--device", "cpu", "--experimental_prefetch_threads", "0", "--model_size", "tiny"]
    for k, v in TINY_OVERRIDES.items():
        args += ["--model_override", f"{k}={v}"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 130, res.output
    line = " ".join(res.stderr.split())
    assert "interrupted; continue with: hydra-train run" in line and line.endswith("--resume"), line
    assert _names(ckpt) == ["hydra_tiny_step10.pt", "hydra_tiny_step15.pt"]
    assert _statuses(ckpt) == ["interrupted"]


def test_run_signals_repeats_and_escalation(monkeypatch, capfd):
    """The handler alone: a repeated SIGTERM within the window is the same request; one after it,
    or a Ctrl-C, quits at once; without a loop to stop, the first signal raises."""
    from hydra_train import run_guard

    clock = [100.0]
    monkeypatch.setattr(run_guard.time, "monotonic", lambda: clock[0])
    asked: list[int] = []
    sig = run_guard.RunSignals()
    sig.stop = lambda s: asked.append(s) is None
    sig._on_signal(signal.SIGTERM, None)
    assert asked == [signal.SIGTERM]
    assert (
        "SIGTERM: stopping after this step and saving a checkpoint; Ctrl-C to quit" in capfd.readouterr().err
    )
    clock[0] += run_guard.REPEATED_SIGTERM_S - 1
    sig._on_signal(signal.SIGTERM, None)  # the same one, delivered again
    with pytest.raises(KeyboardInterrupt) as info:
        sig._on_signal(signal.SIGINT, None)
    assert type(info.value) is KeyboardInterrupt
    clock[0] += 2
    with pytest.raises(Terminated):
        sig._on_signal(signal.SIGTERM, None)
    assert asked == [signal.SIGTERM]

    quiet = run_guard.RunSignals()
    quiet.stop = lambda s: False  # outside the loop
    with pytest.raises(KeyboardInterrupt):
        quiet._on_signal(signal.SIGINT, None)
    assert "stopping" not in capfd.readouterr().err

    before = _handlers()
    restore = run_guard.RunSignals().install()
    assert _handlers() != before
    restore()
    assert _handlers() == before


def test_a_signal_the_process_ignores_stays_ignored():
    """A run started with `&` from a script inherits SIGINT as ignored: installing the run's
    handlers must not make a Ctrl-C meant for the shell stop it; SIGTERM is still handled."""
    from hydra_train import run_guard

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        restore = run_guard.RunSignals().install()
        try:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        finally:
            restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
