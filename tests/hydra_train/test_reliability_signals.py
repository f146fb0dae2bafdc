"""Issue 17, real processes: SIGTERM ends a run with exit 143, its status written and a checkpoint
of the step it stopped at saved (test_interrupt_save.py: in-process cases), a second run
on the same folder is refused while the first lives, and a run killed with SIGKILL in the middle of
a checkpoint write leaves a partial ``*.tmp`` that the next run removes (marking the dead run
``killed``). Each case starts one Python process (torch import: a few seconds).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hydra_train.checkpoint import load_checkpoint
from hydra_train.errors import HydraTrainError
from hydra_train.run import run_training
from hydra_train.run_lock import LOCK_NAME

from .conftest import TINY_OVERRIDES, VOCAB, tiny_config


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"the run ended early (rc {proc.returncode}): {err[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.1)


def _statuses(ckpt: Path) -> list[str]:
    with sqlite3.connect(ckpt / "training.db") as c:
        return [r[0] for r in c.execute("SELECT status FROM runs ORDER BY started_at")]


def _running(ckpt: Path) -> bool:
    if not (ckpt / "training.db").is_file():  # connecting would create it
        return False
    try:
        return _statuses(ckpt) == ["running"]
    except sqlite3.Error:
        return False


def _training(ckpt: Path) -> bool:
    """A step logged: the loop runs (a signal before it ends the run at once, with nothing to save)."""
    if not _running(ckpt):
        return False
    try:
        with sqlite3.connect(ckpt / "training.db") as c:
            return c.execute("SELECT COUNT(*) FROM steps").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def test_sigterm_saves_a_checkpoint_exits_143_with_status_and_a_second_run_is_refused(bin_dataset, tmp_path):
    args = [sys.executable, "-m", "hydra_train", "run", "--dataset", str(bin_dataset)]
    args += ["--vocab_size", str(VOCAB), "--seq_len", "32", "--batch_size", "4"]
    args += ["--max_steps", "100000", "--log_every", "1", "--eval_every", "100000", "--eval_batches", "1"]
    args += ["--save_every", "0", "--checkpoint_dir", str(tmp_path), "--device", "cpu"]
    args += ["--cpu_threads", "1", "--experimental_prefetch_threads", "0", "--model_size", "tiny", "--json"]
    for k, v in TINY_OVERRIDES.items():
        args += ["--model_override", f"{k}={v}"]
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _running(tmp_path), proc)
        with pytest.raises(HydraTrainError, match=rf"another run \(PID {proc.pid} on "):
            run_training(tiny_config(bin_dataset, tmp_path, max_steps=1))
        _wait_for(lambda: _training(tmp_path), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "SIGTERM" in errors[0], err[-2000:]
    # --save_every 0, yet the step it stopped at is saved: the hint resumes from it
    saved = sorted(tmp_path.glob("hydra_tiny_step*.pt"))
    assert len(saved) == 1 and load_checkpoint(saved[0])["step"] >= 1, err[-2000:]
    assert errors[0].endswith("--resume"), err[-2000:]
    assert f"--checkpoint_dir {tmp_path}" in errors[0] and "--seq_len 32" in errors[0], err[-2000:]
    assert "stopping after this step and saving a checkpoint" in err, err[-2000:]
    assert "Traceback" not in err
    assert _statuses(tmp_path) == ["interrupted"]
    assert not (tmp_path / LOCK_NAME).exists()


_KILLED_IN_SAVE = """
import sys, time, pathlib
import torch
from hydra_train.run import run_training
from hydra_train.config import TrainConfig
import json

real = torch.save
def slow_save(obj, f, *a, **kw):
    if hasattr(f, "fileno"):  # the checkpoint's temporary file: half of it, then wait for the kill
        f.write(b"x" * 100000)
        f.flush()
        pathlib.Path(sys.argv[2]).write_text("in save")
        time.sleep(120)
    return real(obj, f, *a, **kw)
torch.save = slow_save
run_training(TrainConfig(**json.loads(sys.argv[1])))
"""


def test_kill_during_a_save_then_the_next_run_cleans_up(bin_dataset, tmp_path):
    import json

    ckpt = tmp_path / "ck"
    cfg = tiny_config(bin_dataset, ckpt, max_steps=6, save_every=3)
    marker = tmp_path / "in_save"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_IN_SAVE), json.dumps(cfg.to_dict()), str(marker)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(marker.exists, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = list(ckpt.glob(".*.tmp"))
    assert partial, "the killed save left no partial file: the test did not kill mid-write"
    assert _statuses(ckpt) == ["running"]
    run_training(cfg)  # a new run in the folder: stale lock taken over, partial file removed
    assert not list(ckpt.glob("*.tmp")) and not list(ckpt.glob(".*.tmp"))
    assert _statuses(ckpt) == ["killed", "finished"]
