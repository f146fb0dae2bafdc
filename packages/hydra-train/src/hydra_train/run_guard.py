"""Guards around a training run: the folder it writes, the runs that died before it, finite weights.

* :func:`open_checkpoint_dir` creates ``--checkpoint_dir`` (one line when it is a file, under a
  read-only filesystem, or not writable), takes the folder lock (:mod:`hydra_train.run_lock`) and
  removes partial ``*.tmp`` files of killed writers.
* :func:`settle_dead_runs` marks runs the database still calls ``running`` as ``killed`` (with the
  lock held, no live run can own them). The rows a dead run logged after the checkpoint a resume
  continues from are dropped when the resuming run is recorded (``TrainingDB.start_run``, which
  knows the run that saved that checkpoint: only that run's lineage loses rows).
* :func:`check_finite_weights` refuses to save weights that hold NaN or inf.
* :class:`RunSignals` turns a first Ctrl-C or SIGTERM during training into a checkpoint at the next
  step boundary and then the interrupt's exit; before the loop, and on a second signal, the
  signal raises at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
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


def interrupt_error(signum: int) -> KeyboardInterrupt:
    """What a run raises for ``signum``: :class:`Terminated` for SIGTERM, else KeyboardInterrupt."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


#: A SIGTERM this soon after a first one is that one delivered again, not a request to quit at once:
#: a cluster (Slurm's preemption, its time limit) signals every process of a job, and torchrun,
#: signalled too, forwards its own to each worker within milliseconds.
REPEATED_SIGTERM_S = 5.0

_STOPPING = "stopping after this step and saving a checkpoint; Ctrl-C again to quit at once"


class RunSignals:
    """SIGINT (Ctrl-C) and SIGTERM (what a cluster sends before preempting a job) during a run.

    The first one, while the training loop runs, becomes a request to stop at the next step
    boundary (``stop(signum)``, the trainer's :meth:`~hydra_train.trainer.Trainer.interrupt`,
    returns True): the loop ends there, the step is saved as any checkpoint is, then the run
    raises :func:`interrupt_error` (exit 130 or 143, status "interrupted"). A line says so at once.
    Outside the loop (the setup, the pretests, the first evaluation, the final save) there is no
    step to save: the signal raises at once, as it always did. A second signal raises at once
    too (the drain, the save itself: an atomic write leaves no partial file), except a SIGTERM
    repeated within :data:`REPEATED_SIGTERM_S` (the same one, delivered twice)."""

    def __init__(self, *, announce: bool = True) -> None:
        #: set once the trainer exists; None until then (a signal raises at once)
        self.stop: Callable[[int], bool] | None = None
        self.announce = announce  # the line on the first signal: rank 0 only under torchrun
        self._first: tuple[int, float] | None = None  # the first signal and when it came

    def install(self) -> Callable[[], None]:
        """Handle both signals in this (the main) thread; returns what restores the previous
        handlers (a no-op outside the main thread, where signals cannot be handled)."""
        # a signal the process ignores stays ignored (a run started with `&` from a script inherits
        # SIGINT as SIG_IGN: a Ctrl-C meant for the shell must not stop it)
        wanted = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
        try:
            previous = {s: signal.signal(s, self._on_signal) for s in wanted}
        except ValueError:  # not the main thread (SIGINT is installed first: nothing to undo)
            return lambda: None

        def restore() -> None:
            for s, handler in previous.items():  # None: one set outside Python, not restorable
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)

        return restore

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self._first is not None:
            first, at = self._first
            if signum == first == signal.SIGTERM and now - at < REPEATED_SIGTERM_S:
                return
            raise interrupt_error(signum)
        self._first = (signum, now)
        if self.stop is None or not self.stop(signum):
            raise interrupt_error(signum)
        if self.announce:
            line = _STOPPING if signum != signal.SIGTERM else f"SIGTERM: {_STOPPING}".replace(" again", "")
            # a raw write: print() here could re-enter a write the main thread is inside
            with contextlib.suppress(OSError):
                os.write(2, f"{line}\n".encode())
