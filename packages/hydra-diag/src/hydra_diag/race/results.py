"""The race's JSON document: settings, data, environment and one entry per configuration; loading
saved documents and merging runs made separately (refused when they were not run alike).

Merging is how long races are split (``gpt`` in one process, ``hydra`` in another): the runs must
share every field of :data:`MUST_MATCH` (the data, the sequence and batch shape, the budget, the
evaluation points, the schedule, the device), and a configuration may appear in only one of them.

The training data is matched on ``data.train_digest`` (every training token, race/data.py): the
validation digest and the window counts can agree while the training streams differ (a pyenv
corpus of FORMAT_VERSION 2 against 3). Files written before the digest was recorded lack it: such
a file is merged (its results stay usable) with a warning that its training data went unchecked,
and the merged document records no digest, so a later merge with it warns again. Their pyenv
token counts (``data.tokens``, always recorded) are still compared, which refuses the case that
made the digest necessary.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra_diag.output import DiagError, jsonable

KIND = "hydra-diag race"
VERSION = 1
#: dotted paths that must agree between runs that are merged into one table
MUST_MATCH = (
    "settings.model_size",
    "settings.budget_s",
    "settings.seq_len",
    "settings.batch_size",
    "settings.evals",
    "settings.val_windows",
    "settings.warmup_frac",
    "settings.min_lr_ratio",
    "settings.weight_decay",
    "settings.grad_clip",
    "settings.seed",
    "data.name",
    "data.extensions",
    "data.val_digest",
    "data.vocab_size",
    "data.train_windows",
    "data.tokens",  # pyenv: tokens per split (None for other data, whose train_digest says more)
    "environment.device_name",
)
#: the training stream's identity; checked apart from MUST_MATCH, since older files lack it
TRAIN_DIGEST = "data.train_digest"
_RETRY = "race again on one copy of the data (the same corpus build or shards) and merge those runs"
#: what to do, after "field differs (a vs b)", where the field's name does not say it
REMEDY = {
    "data.tokens": "the corpora were tokenized differently (other source files, or pyenv caches of "
    f"another format, e.g. before and after FORMAT_VERSION 3); {_RETRY}",
    TRAIN_DIGEST: "the runs trained on different token streams, whatever their validation windows "
    "(another corpus build, e.g. a pyenv cache before and after FORMAT_VERSION 3, or other "
    f"shards); {_RETRY}",
}


def environment(device) -> dict[str, Any]:
    """Where and how the race ran: device, library versions, date, the exact command."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if cuda
        else f"cpu ({platform.processor() or 'cpu'})",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": "hydra-diag " + shlex.join(sys.argv[1:]),
    }


def new_document(settings: dict[str, Any], data: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": KIND,
        "version": VERSION,
        "settings": settings,
        "data": data,
        "environment": env,
        "runs": [],
    }


def _get(doc: dict[str, Any], dotted: str) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def load_document(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DiagError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DiagError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise DiagError(f"{path}: not a race result (written by hydra-diag race run --json)")
    return doc


def _differs(name: str, other: str, field: str, b: Any, a: Any) -> DiagError:
    remedy = f": {REMEDY[field]}" if field in REMEDY else ""
    return DiagError(f"cannot merge {name} with {other}: {field} differs ({b!r} vs {a!r}){remedy}")


def _warn_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def merge_documents(
    docs: list[tuple[str, dict[str, Any]]], warn: Callable[[str], None] = _warn_stderr
) -> dict[str, Any]:
    """One document from several runs; DiagError naming the field (or configuration) that clashes.
    ``warn`` gets one line when a file records no training digest (written before it existed)."""
    if not docs:
        raise DiagError("race merge needs at least one JSON file")
    first_name, first = docs[0]
    for name, doc in docs[1:]:
        for field in MUST_MATCH:
            a, b = _get(first, field), _get(doc, field)
            if a != b:
                raise _differs(name, first_name, field, b, a)
    known = [(name, _get(doc, TRAIN_DIGEST)) for name, doc in docs if _get(doc, TRAIN_DIGEST) is not None]
    for name, digest in known[1:]:  # against the first file that has one: it need not be docs[0]
        if digest != known[0][1]:
            raise _differs(name, known[0][0], TRAIN_DIGEST, digest, known[0][1])
    unchecked = [name for name, doc in docs if _get(doc, TRAIN_DIGEST) is None]
    merged = json.loads(json.dumps(first))
    if unchecked:  # the merge vouches for no digest: a later merge with it must warn again
        merged.get("data", {}).pop("train_digest", None)
    merged.pop("plots", None)  # the first file's PNGs show its own runs only: not the merge's
    merged["runs"] = []
    merged["merged_from"] = []
    seen: dict[str, str] = {}
    for name, doc in docs:
        for run in doc.get("runs", []):
            if run["name"] in seen:
                raise DiagError(
                    f"cannot merge: configuration {run['name']} is in both {seen[run['name']]} and {name}"
                )
            seen[run["name"]] = name
            merged["runs"].append({**run, "source": name})
        env = doc.get("environment", {})
        merged["merged_from"].append(
            {
                "file": name,
                "command": env.get("command"),
                "date": env.get("date"),
                "train_digest": _get(doc, TRAIN_DIGEST),
            }
        )
    if unchecked:  # said once the merge is sure to succeed, not before a refusal
        warn(
            f"warning: race merge: {', '.join(unchecked)} record(s) no {TRAIN_DIGEST} (written before "
            "races recorded it), so their training data could not be checked"
            + (" against the others'" if known else "")
            + "; merged on the validation digest and the window (and pyenv token) counts alone. If "
            "the runs may have read different corpus builds (a pyenv cache before and after "
            "FORMAT_VERSION 3), race them again"
        )
    return merged


def write_document(doc: dict[str, Any], path: str) -> None:
    """``path`` "-" prints to stdout; otherwise the file (folders created), replaced whole: a crash
    while writing leaves the previous document (the race writes one after each entrant)."""
    text = json.dumps(jsonable(doc), indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    from hydra_train.atomic_files import atomic_write_bytes

    atomic_write_bytes(Path(path), text.encode("utf-8"))
