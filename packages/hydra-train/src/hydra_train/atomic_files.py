"""Atomic file writes: the bytes go to a temporary file in the target's folder, are flushed and
fsync'ed, and the file is renamed over the final name (``os.replace`` is atomic on POSIX), so a
reader or a crash sees either the old file or the whole new one, never a partial write.

Checkpoints, tokenizers, token shards, metrics exports and pretest logs all go through here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(folder: Path) -> None:
    """fsync a folder so that a rename inside it survives a power cut (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` can only
    be read by setting it, which another thread could see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode_for(path: Path) -> int:
    """The permissions ``path`` gets: those of the file it replaces, else what ``open()`` would give
    a new file (0o666 less the umask). ``mkstemp`` makes its file 0o600, so without this a
    checkpoint or tokenizer was readable by its owner alone, and a replaced file lost its mode."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~current_umask()


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` (and its folders) from what ``write`` writes into the binary file it is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = file_mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # POSIX (Windows has no such modes)
                os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    atomic_write(path, lambda f: f.write(data))
