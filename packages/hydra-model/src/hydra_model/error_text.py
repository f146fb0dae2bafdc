"""One-line error texts: another library's long message shortened to whole sentences, and the
line for an output the command line cannot write.

torch's message for a damaged checkpoint is four sentences (351 characters); cut at a fixed
length it ended mid-word ("... there is a high"). :func:`shortened` keeps whole sentences.

Writing a command's output (export-hf's folder, import-hf's file) raised the OSError of whichever
call met the problem first (mkdir, a rename), and the command line printed its traceback.
:func:`writing` turns an OSError while writing into :class:`OutputNotWritable`, whose text names
the output, why (the part of the path that is a file, a permission, a full disk) and what to do.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def shortened(text: str, limit: int) -> str:
    """The first line of ``text``, cut after the last whole sentence that ends within ``limit``
    characters; without such a sentence, at the last space within it, with "…"."""
    lines = text.strip().splitlines()
    first = lines[0].strip() if lines else ""
    if len(first) <= limit:
        return first
    head = first[: limit + 1]  # + 1: a sentence may end exactly at the limit, its space after it
    end = head.rfind(". ")
    if end > 0:
        return head[: end + 1]
    space = head.rfind(" ", 0, limit)
    return (head[:space] if space > 0 else first[: limit - 1]) + "…"


class OutputNotWritable(OSError):
    """An output file or folder could not be written; the text is one line naming it, the reason
    and what to do (an OSError still, for callers that catch the one they had)."""


def _file_in_the_way(path: Path) -> Path | None:
    """The first part of ``path`` that exists and is not a folder (ENOTDIR: mkdir cannot pass it)."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return None


def unwritable(exc: OSError, target: Path, what: str) -> str:
    """The line for ``exc``, met while writing ``what`` (e.g. "the export folder") at ``target``."""
    reason = exc.strerror or str(exc)
    where = Path(exc.filename) if exc.filename else target
    blocker = _file_in_the_way(where) if exc.errno in (errno.ENOTDIR, errno.EEXIST) else None
    # the file the error names, when it is not the output itself (a file inside the folder)
    why = reason if where == target else f"{reason} writing {where}"
    if blocker is not None:
        why = f"{blocker} is a file, not a folder"
        todo = "choose a path whose folders are folders"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "free some space there or choose a folder on another disk"
    elif exc.errno == errno.EROFS:
        todo = "choose a folder on a writable disk"
    elif exc.errno == errno.EISDIR:  # import-hf's OUT.pt is an existing folder
        why, todo = "it is a folder", "name a file there, not a folder"
    else:  # EACCES, EPERM and the rare rest: the user picks another place
        todo = "choose a folder you can write to (or give yourself write permission there)"
    return f"cannot write {what} {target}: {why}; {todo}"


@contextmanager
def writing(target: Path, what: str, reading: tuple[Path | None, ...] = ()) -> Iterator[None]:
    """Raise an OSError met in the block as :class:`OutputNotWritable` (see :func:`unwritable`),
    but one about a file of ``reading`` (an input the block copies, e.g. a tokenizer) as it is: a
    read that failed is not the output's fault, and "choose a folder you can write to" would
    mislead."""
    try:
        yield
    except OutputNotWritable:
        raise
    except OSError as exc:
        if exc.filename and any(p is not None and Path(exc.filename) == Path(p) for p in reading):
            raise
        raise OutputNotWritable(unwritable(exc, target, what)) from exc
