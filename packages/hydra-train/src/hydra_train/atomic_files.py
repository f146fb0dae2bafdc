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


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` (and its folders) from what ``write`` writes into the binary file it is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
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
