"""The embedded default corpus: the Python standard library's own ``.py`` source.

Every machine that runs Python has it, so ``hydra-train run`` needs no download. Two variants:

``stdlib``       the library without its test suites (``test``/``tests``/``idle_test`` folders),
                 about 11 MB on CPython 3.11: small enough to tokenize in seconds on a laptop.
``stdlib-full``  every ``.py`` file of the library, tests included (about 30 MB), for GPU runs
                 that would otherwise see the small variant many times over.

``site-packages`` is never included (it is what the user installed, not the library).

Split: a file goes to validation when the first byte of sha1(relative path) is below
``256 * VAL_PERCENT / 100``; the split therefore depends only on the path, is the same on every
run and machine, and never puts part of a file on each side. The corpus fingerprint hashes every
relative path and file content, so a different Python version gives a different cache key.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hydra_train.errors import HydraDataError
from hydra_train.options import train_options

VAL_PERCENT = 5
_TEST_DIRS = {"test", "tests", "idle_test"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusDoc:
    relpath: str
    text: str


@dataclass(frozen=True)
class Corpus:
    name: str
    root: Path
    train: list[CorpusDoc]
    val: list[CorpusDoc]
    fingerprint: str

    def describe(self) -> str:
        n_chars = sum(len(d.text) for d in self.train) + sum(len(d.text) for d in self.val)
        return (
            f"{self.name}: {len(self.train)} train + {len(self.val)} validation files, "
            f"{n_chars / 1e6:.1f}M characters from {self.root}"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation_path(relpath: str) -> bool:
    """The deterministic split rule (see the module docstring)."""
    first_byte = hashlib.sha1(relpath.encode("utf-8")).digest()[0]
    return first_byte < 256 * VAL_PERCENT // 100


def _wanted(rel_parts: tuple[str, ...], with_tests: bool) -> bool:
    dirs = set(rel_parts[:-1])
    if dirs & _SKIP_DIRS:
        return False
    return with_tests or not (dirs & _TEST_DIRS)


def load_stdlib_corpus(name: str = "stdlib", root: Path | None = None) -> Corpus:
    """Read the standard library sources (sorted by relative path) and split them."""
    if name not in ("stdlib", "stdlib-full"):
        raise HydraDataError(f"unknown embedded corpus {name!r}; use 'stdlib' or 'stdlib-full'")
    root = root or stdlib_root()
    if not root.is_dir():
        raise HydraDataError(f"the Python standard library was not found at {root}")
    with_tests = name == "stdlib-full"
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                p = Path(dirpath, fn)
                rel = p.relative_to(root)
                if _wanted(rel.parts, with_tests):
                    paths.append((rel.as_posix(), p))
    paths.sort()
    h = hashlib.sha256(name.encode())
    train: list[CorpusDoc] = []
    val: list[CorpusDoc] = []
    for rel, p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue  # unreadable library files (permissions) are simply not part of the corpus
        h.update(rel.encode("utf-8") + b"\0" + data + b"\0")
        doc = CorpusDoc(rel, data.decode("utf-8", errors="replace"))
        (val if is_validation_path(rel) else train).append(doc)
    if not train or not val:
        raise HydraDataError(
            f"the standard library at {root} gave {len(train)} train and {len(val)} validation files; "
            "the embedded corpus needs both (is the library installed without its sources?)"
        )
    return Corpus(name, root, train, val, h.hexdigest()[:16])


def cache_dir() -> Path:
    """``$HYDRA_CACHE_DIR`` or ``~/.cache/hydra`` (:mod:`hydra_train.options`): tokenizers and
    tokenized corpora live here."""
    return train_options().cache_dir


def _cache_hint(err: int | None) -> str:
    if err in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space or set HYDRA_CACHE_DIR to a folder on another disk"
    return "set HYDRA_CACHE_DIR to a folder you can write to"


@contextmanager
def writing_cache(folder: Path) -> Iterator[None]:
    """Around a write into the cache: ``folder`` is made and checked writable first (before a
    tokenizer is trained for minutes only to be lost), and an OSError of the write becomes one line
    that names HYDRA_CACHE_DIR (the run's generic I/O line named --checkpoint_dir, which does not
    move the cache). An error on a file outside the cache (a source being read) passes through."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HydraDataError(
            f"cannot create the cache folder {folder}: {exc.strerror or exc}; {_cache_hint(exc.errno)}"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise HydraDataError(f"the cache folder {folder} is not writable; {_cache_hint(None)}")
    try:
        yield
    except OSError as exc:
        name = Path(os.fsdecode(exc.filename)) if exc.filename else None
        if name is not None and not name.is_relative_to(folder):
            raise
        where = f"{name}: " if name else f"{folder}: "
        raise HydraDataError(
            f"cannot write the cache: {where}{exc.strerror or exc}; {_cache_hint(exc.errno)}"
        ) from None
