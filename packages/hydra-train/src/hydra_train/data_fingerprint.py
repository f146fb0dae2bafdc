"""A cheap fingerprint of a run's window layout, kept in every checkpoint, so that ``--resume``
notices data that changed since the checkpoint was written.

The batch order (:class:`hydra_train.dataset.BatchPlan`) is recomputed from the data on every
start; a checkpoint only holds how many micro-batches were consumed. Shards added, removed or
replaced, another ``--seq_len`` or another tokenizer give other windows, and the resumed run
would go on in another order (repeating or skipping data) without a word.

What is recorded (``ck["data"]["fingerprint"]``, plain values, so ``weights_only`` loading reads
it)::

    version                  1
    seq_len, vocab_size      the windows' length and the vocabulary
    train_windows            windows the batch order permutes (after any held-out tail)
    val_windows              validation windows
    shards                   [name, tokens, edges] for each shard in order, train then validation
                             (validation shards only when they are not the training shards':
                             a held-out tail shares them). name: the path relative to the folder
                             all shards share (a moved or copied dataset keeps its names; packed
                             text files: their folder); tokens: the token count
                             (row shards: rows x row length); edges: 12 hex digits of a SHA-1 of
                             the first and last EDGE_TOKENS tokens (rows: first and last row).
                             Above MAX_LISTED shards: None (the checkpoint stays small), and the
                             digest alone tells a change, without naming the shards
    shard_count              the number of shards
    digest                   16 hex digits of a SHA-256 over all of the above
    summary                  one human-readable line

Not a content hash: shards can be many GB, and reading them all on each start and save would
cost minutes. A change inside a shard that keeps its length and its first and last tokens goes
unnoticed; appending, truncating, replacing or re-tokenizing a shard does not.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from hydra_train.dataset import TokenDataset, WindowView, as_view
from hydra_train.errors import HydraCheckpointError

VERSION = 1
#: tokens read at each end of a shard (rows: one row at each end)
EDGE_TOKENS = 64
#: shards recorded one by one (about 60 bytes each in the checkpoint); above it only their digest
MAX_LISTED = 1000
#: names listed in one message before "... (N in all)"
_LIST = 5


def _edges(tokens: np.ndarray) -> str:
    if tokens.ndim == 2:
        ends = [tokens[:1], tokens[-1:]] if len(tokens) else []
    else:
        ends = [tokens[:EDGE_TOKENS], tokens[-EDGE_TOKENS:]]
    h = hashlib.sha1()
    for part in ends:  # int64 whatever the file's width: a uint16 and a uint32 copy agree
        h.update(np.asarray(part, dtype=np.int64).tobytes())
    return h.hexdigest()[:12]


def data_fingerprint(train: TokenDataset | WindowView, val: TokenDataset | WindowView) -> dict[str, Any]:
    """The fingerprint of a run's train and validation data (see the module docstring)."""
    tv, vv = as_view(train), as_view(val)
    shards = list(tv.base.shards)
    if vv.base is not tv.base:
        shards += vv.base.shards
    paths = [Path(s.path) for s in shards]
    # the folder every shard sits in: a file's folder, or a packed text group's own path (the
    # folder its files share), so that a copied or renamed dataset keeps every name
    root = Path(
        os.path.commonpath([p if s.files > 1 else p.parent for s, p in zip(shards, paths, strict=True)])
    )
    rows = []
    for s, p in zip(shards, paths, strict=True):
        name = p.relative_to(root).as_posix()
        if s.files > 1:  # not their count: a file added is the group's length changing
            name = f"{name}/ (packed text files)" if name != "." else "(packed text files)"
        rows.append([name, s.num_tokens, _edges(s.tokens)])
    fp: dict[str, Any] = {
        "version": VERSION,
        "seq_len": tv.seq_len,
        "vocab_size": tv.vocab_size,
        "train_windows": tv.num_windows,
        "val_windows": vv.num_windows,
        "shards": rows,
        "shard_count": len(rows),
    }
    fp["digest"] = _digest(fp)
    if len(rows) > MAX_LISTED:
        fp["shards"] = None
    fp["summary"] = (
        f"{tv.num_windows} train / {vv.num_windows} val windows of {tv.seq_len + 1} tokens, vocab "
        f"{tv.vocab_size}, {len(rows)} shard(s) of {sum(r[1] for r in rows)} tokens"
    )
    return fp


def _digest(fp: dict[str, Any]) -> str:
    body = {k: fp[k] for k in ("version", "seq_len", "vocab_size", "train_windows", "val_windows", "shards")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _names(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > _LIST else ""
    return ", ".join(names[:_LIST]) + more


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, one phrase each ("train windows 340 -> 467",
    "shards added: train/part2.bin (4000 tokens)"); empty when they describe the same data."""
    if saved.get("digest") == now["digest"]:
        return []
    out = []
    for key, what in (
        ("seq_len", "seq_len"),
        ("vocab_size", "vocab size"),
        ("train_windows", "train windows"),
        ("val_windows", "val windows"),
    ):
        if saved.get(key) != now[key]:
            out.append(f"{what} {saved.get(key)} -> {now[key]}")
    if saved.get("shards") is None or now["shards"] is None:  # too many shards to have kept them
        if saved.get("shard_count") != now["shard_count"]:
            out.append(f"shards {saved.get('shard_count')} -> {now['shard_count']}")
        return out or [f"shards differ (too many to name; digest {saved.get('digest')} -> {now['digest']})"]
    old = {n: (t, e) for n, t, e in saved["shards"]}
    new = {n: (t, e) for n, t, e in now["shards"]}
    added = [f"{n} ({new[n][0]} tokens)" for n in new if n not in old]
    removed = [n for n in old if n not in new]
    if added:
        out.append(f"shards added: {_names(added)}")
    if removed:
        out.append(f"shards removed: {_names(removed)}")
    resized = [f"{n} {old[n][0]} -> {new[n][0]} tokens" for n in new if n in old and old[n][0] != new[n][0]]
    if resized:
        out.append(f"shards changed length: {_names(resized)}")
    other = [n for n in new if n in old and old[n][0] == new[n][0] and old[n][1] != new[n][1]]
    if other:
        out.append(f"shards with other tokens at the same length (replaced or re-tokenized): {_names(other)}")
    same = [n for n in new if n in old]
    if not (added or removed) and same != [n for n in old if n in new]:
        out.append("shard order changed")
    if not out:  # a fingerprint of another version, or a field this one does not compare
        out.append(f"data fingerprint {saved.get('digest')} -> {now['digest']}")
    return out


def check_resume_data(
    ck: dict[str, Any], fingerprint: dict[str, Any], allow_change: bool, path: Path
) -> list[str]:
    """Compare checkpoint ``ck``'s data fingerprint with this run's: a difference is refused
    (:class:`HydraCheckpointError` naming it and ``--allow_data_change``), or with ``allow_change``
    a warning; a checkpoint without one (older) gets a note. Returns the lines to log."""
    saved = ck.get("data", {}).get("fingerprint")
    if saved is None:
        return [
            f"note: {path.name} holds no data fingerprint (written by an older hydra-train): the "
            "data could not be checked against the checkpoint's"
        ]
    changes = data_changes(saved, fingerprint)
    if not changes:
        return []
    if not allow_change:
        raise HydraCheckpointError(
            f"{path} was saved on other data than this run's: {'; '.join(changes)}. Resuming would "
            "continue a different window order (data repeated or skipped). Resume on the original data, "
            "or pass --allow_data_change to continue on this data (the batch order is recomputed from it)"
        )
    return [
        f"warning: resume: the data differs from {path.name}'s ({'; '.join(changes)}); "
        "--allow_data_change: the batch order is recomputed from this data and continues at the "
        "checkpoint's position in it, so some windows may be repeated or skipped"
    ]
