"""One run per checkpoint folder: a lock file holding the owner's PID and host.

Two runs writing the same ``--checkpoint_dir`` would interleave checkpoints, prune each other's
files and leave a summary pointing at the other run's weights. :class:`FolderLock` creates
``<dir>/.hydra-train.lock`` with ``O_CREAT | O_EXCL`` (atomic: exactly one creator wins) and writes
``pid host`` into it. A lock whose PID is dead on this host is stale (a run killed with ``kill -9``)
and is taken over with a message; a live holder makes the second run stop with one line naming it.
Holding the lock also means any ``*.tmp`` file in the folder belongs to a dead writer
(:func:`remove_stale_tmp_files`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from hydra_train.errors import HydraTrainError

LOCK_NAME = ".hydra-train.lock"


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this machine (signal 0 checks without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class FolderLock:
    """Exclusive lock on a checkpoint folder; use as a context manager or call acquire/release."""

    def __init__(self, folder: str | Path, log: Callable[[str], None] = print):
        self.path = Path(folder) / LOCK_NAME
        self.log = log
        self.held = False
        self.took_over: str | None = None  # "pid host" of the dead run whose lock was taken over

    def _read_holder(self) -> tuple[int, str]:
        try:
            pid, host = self.path.read_text().split()[:2]
            return int(pid), host
        except (OSError, ValueError):
            return -1, "?"

    def acquire(self) -> None:
        me = f"{os.getpid()} {socket.gethostname()}\n"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pid, host = self._read_holder()
                if host == socket.gethostname() and not pid_alive(pid):
                    self.log(f"taking over the stale lock {self.path} of run PID {pid} (no longer running)")
                    self.took_over = f"{pid} {host}"
                    self.path.unlink(missing_ok=True)
                    continue
                if pid == -1:  # being written this instant, or garbage: treat as held
                    raise HydraTrainError(
                        f"{self.path} exists but names no run; if no run uses this folder, delete it"
                    ) from None
                raise HydraTrainError(
                    f"another run (PID {pid} on {host}) is using {self.path.parent}; wait for it, stop "
                    f"it, or use another --checkpoint_dir (if it is dead, delete {self.path})"
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return
        raise HydraTrainError(f"could not take the lock {self.path}; try again")

    def release(self) -> None:
        if self.held:
            pid, _ = self._read_holder()
            if pid == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_stale_tmp_files(folder: str | Path, log: Callable[[str], None] = print) -> list[Path]:
    """Delete the ``*.tmp`` files (partial atomic writes) in ``folder``; call only with the lock held,
    when no live writer can own them."""
    removed = []
    for p in Path(folder).glob("*.tmp"):
        if p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    if removed:
        names = ", ".join(p.name for p in removed)
        log(f"removed {len(removed)} partial file(s) left by a killed run: {names}")
    return removed
