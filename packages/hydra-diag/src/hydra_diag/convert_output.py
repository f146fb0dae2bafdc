"""The output folder of ``convert jsonl-to-pt`` / ``chat-to-pt`` (:mod:`hydra_diag.convert`).

hydra-train reads every shard of ``--dataset OUT`` (``OUT/train/`` and ``OUT/val/`` when there is a
``train/``, else the folder's own files; see ``hydra_train.data_sources``), so whatever lies there
beside new shards is trained on with them. Hence: the shards of an earlier conversion (named
``partNNNNN.pt`` under a ``meta.json`` of this format) are removed when the new ones move in, any
other data there is refused, and the new output is built in a staging folder inside ``OUT`` and
moved into place only when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from hydra_diag.output import DiagError

META_FORMAT = "hydra-diag-shards/1"
SHARD_NAME = re.compile(r"part\d{5}\.pt")
#: Where hydra-train looks for shards in a dataset folder; convert writes into the first three.
DATA_FOLDERS = ("", "train", "val", "validation")


def _written_by_convert(out: Path) -> bool:
    try:
        return json.loads((out / "meta.json").read_text(encoding="utf-8")).get("format") == META_FORMAT
    except (OSError, ValueError, AttributeError):  # absent, unreadable, or not a JSON object
        return False


def earlier_shards(out: Path) -> list[Path]:
    """The shards an earlier conversion left in ``out``, to be replaced; a :class:`DiagError`
    naming them when ``out`` holds other data hydra-train would read beside the new shards."""
    from hydra_train.shards import SHARD_SUFFIXES

    if out.exists() and not out.is_dir():
        raise DiagError(f"--out {out} is a file; pass a folder")
    ours = _written_by_convert(out)
    earlier: list[Path] = []
    other: list[Path] = []
    for sub in DATA_FOLDERS:
        folder = out / sub
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.suffix.lower() in SHARD_SUFFIXES:
                mine = ours and sub != "validation" and SHARD_NAME.fullmatch(f.name)
                (earlier if mine else other).append(f)
    if other:
        names = ", ".join(str(f.relative_to(out)) for f in other[:3]) + (", ..." if len(other) > 3 else "")
        raise DiagError(
            f"--out {out} already holds data ({names}) that hydra-train run --dataset {out} would "
            "read together with the new shards; choose an empty or new folder"
        )
    return earlier


def missing_folders(out: Path) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, deepest first: what
    :func:`staging_folder` creates, and a failed conversion removes again (OUT left as it was)."""
    missing = []
    for p in (out, *out.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def remove_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: a folder something else wrote into
    meanwhile stays, and so do its parents."""
    for f in folders:
        try:
            f.rmdir()
        except OSError:
            return


def staging_folder(out: Path) -> Path:
    """A fresh hidden folder inside ``out`` (same file system: moving out of it is a rename)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".convert-", dir=out))
    except OSError as exc:
        in_the_way = next((p for p in (out, *out.parents) if p.is_file()), None)
        why = f"{in_the_way} is a file, not a folder" if in_the_way else exc.strerror or str(exc)
        raise DiagError(f"--out {out}: cannot write there ({why})") from None


def move_into_place(stage: Path, out: Path, earlier: list[Path]) -> None:
    """Replace the ``earlier`` shards with the files built in ``stage``; ``meta.json`` goes last,
    once the shards it lists are in place."""
    for f in earlier:
        f.unlink()
    for sub in DATA_FOLDERS[:3]:
        src = stage / sub
        if not src.is_dir():
            continue
        (out / sub).mkdir(exist_ok=True)
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "meta.json":
                os.replace(f, out / sub / f.name)
    for folder in {f.parent for f in earlier} - {out}:
        if not any(folder.iterdir()):  # an earlier train/ or val/ left empty would hide OUT's shards
            folder.rmdir()
    os.replace(stage / "meta.json", out / "meta.json")
    shutil.rmtree(stage)
