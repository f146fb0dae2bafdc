"""Guards around a training run: the folder it writes, the runs that died before it, finite weights.

* :func:`open_checkpoint_dir` creates ``--checkpoint_dir`` (one line when it is a file, under a
  read-only filesystem, or not writable), takes the folder lock (:mod:`hydra_train.run_lock`) and
  removes partial ``*.tmp`` files of killed writers.
* :func:`settle_dead_runs` marks runs the database still calls ``running`` as ``killed`` (with the
  lock held, no live run can own them). The rows a dead run logged after the checkpoint a resume
  continues from are dropped when the resuming run is recorded (``TrainingDB.start_run``, which
  knows the run that saved that checkpoint: only that run's lineage loses rows).
* :func:`check_finite_weights` refuses to save weights that hold NaN or inf.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch

from hydra_train.errors import HydraDivergedError, HydraTrainError
from hydra_train.run_lock import FolderLock, remove_stale_tmp_files


def os_error_line(exc: OSError, what: str) -> str:
    """One line for an OSError while doing ``what``: the cause, the file, what to do."""
    where = f" {exc.filename}" if exc.filename else ""
    cause = exc.strerror or str(exc)
    hint = {
        errno.ENOSPC: "free disk space or use another --checkpoint_dir",
        errno.EDQUOT: "free disk space or use another --checkpoint_dir",
        errno.EROFS: "use a writable --checkpoint_dir",
        errno.EACCES: "check the permissions of that path (or use another --checkpoint_dir)",
        errno.EPERM: "check the permissions of that path (or use another --checkpoint_dir)",
        errno.EEXIST: "--checkpoint_dir must be a folder; pass another path",
        errno.ENOTDIR: "--checkpoint_dir must be a folder; pass another path",
    }.get(exc.errno or 0, "check the path and the disk")
    return f"{what}:{where}: {cause}; {hint}"


def open_checkpoint_dir(folder: Path, log: Callable[[str], None]) -> FolderLock:
    """Create ``folder``, lock it for this run and clean it (see the module docstring)."""
    try:
        if folder.exists() and not folder.is_dir():
            raise HydraTrainError(f"--checkpoint_dir {folder} is a file, not a folder; pass another path")
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise HydraTrainError(f"--checkpoint_dir {folder} is not writable; use a folder you can write to")
        lock = FolderLock(folder, log=log)
        lock.acquire()
    except OSError as exc:
        raise HydraTrainError(os_error_line(exc, "cannot use --checkpoint_dir")) from None
    try:
        remove_stale_tmp_files(folder, log=log)
    except OSError as exc:
        lock.release()
        raise HydraTrainError(os_error_line(exc, "cannot clean --checkpoint_dir")) from None
    return lock


def settle_dead_runs(db, log: Callable[[str], None]) -> None:
    """``running`` rows become ``killed``. The rows a resume supersedes are dropped by
    ``start_run``, which is told which run the resume continues (dropping every run's rows of the
    model here deleted other, finished runs' rows too)."""
    dead = [r["run_id"] for r in db.query("SELECT run_id FROM runs WHERE status='running'")]
    if dead:
        db.conn.executemany("UPDATE runs SET status='killed' WHERE run_id=?", [(r,) for r in dead])
        log(f"marked {len(dead)} run(s) that died without a status as killed: {', '.join(dead)}")
    db.commit()


def check_finite_weights(state: dict[str, torch.Tensor], step: int) -> None:
    """Raise :class:`HydraDivergedError` when a floating-point tensor of the model state dict
    ``state`` (the full one a checkpoint gets, also under FSDP) holds NaN or inf."""
    names = [
        n
        for n, t in state.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if names:
        raise HydraDivergedError(
            f"training diverged: the weights are not finite at step {step} ({names[0]} and "
            f"{len(names) - 1} more); no checkpoint saved. Lower --lr or --grad_clip and resume from "
            "the last checkpoint (--resume)"
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (status written, then exit 143)."""


def install_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into :class:`Terminated` in the main thread; returns the function that restores
    the previous handler (a no-op outside the main thread, where signals cannot be handled)."""

    def on_term(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, previous)
