"""The race's data: one deterministic stream of ``[B, T]`` training windows and one fixed set of
validation windows, shared by every configuration.

Training batch ``k`` is hydra-train's :class:`~hydra_train.dataset.BatchPlan` batch ``k`` (windows
of ``T + 1`` tokens in a permutation seeded by ``seed`` and the epoch), so every configuration that
reaches step ``k`` has seen exactly the same tokens in the same order. Validation uses
``val_windows`` windows spread evenly over the validation split (the split's files are in hash
order, so they sample every package), always the same ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress

#: the vocabulary where neither --vocab_size nor the dataset names one (pyenv's BPE size)
DEFAULT_VOCAB = 32000
#: tokens converted and hashed at a time by train_digest (memory stays bounded on any split)
DIGEST_CHUNK = 1 << 24


@dataclass
class RaceData:
    train: Any  # TokenDataset or WindowView
    val: Any
    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int
    val_windows: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from hydra_train.dataset import BatchPlan

        self.plan = BatchPlan(self.train, self.batch_size, seed=self.seed)
        n = self.val.num_windows
        k = min(self.val_windows, n)
        self.val_ids = sorted({int(i) for i in np.linspace(0, n - 1, k).round()})
        self._val_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def train_windows(self) -> int:
        return int(self.train.num_windows)

    @property
    def train_tokens(self) -> int:
        """Tokens of the training split that windows cover (what one epoch is)."""
        return self.train_windows * self.seq_len

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training batch ``k``: (input_ids, targets), ``[B, T]`` int64 on the CPU."""
        return self.plan.batch(k)

    def epochs(self, steps: int) -> float:
        """Passes over the training split that ``steps`` batches make."""
        return steps * self.batch_size / self.train_windows

    def val_digest(self) -> str:
        """sha1 of the validation windows' tokens: the data's identity when runs are merged (the
        corpus cache key follows file mtimes, which a fresh machine from the same image may not keep)."""
        h = hashlib.sha1()
        for j in self.val_ids:
            h.update(np.asarray(self.val.window(j), dtype="<i8").tobytes())
        return h.hexdigest()[:16]

    def train_digest(self) -> str:
        """sha1 of every token the training windows cover, in window order: the training stream's
        identity when runs are merged. val_digest alone is not one: two builds of a corpus can
        agree on the validation windows and differ in training (pyenv FORMAT_VERSION 3 encodes a
        literal end-of-text string in a training file as text, which shifts every later window).
        All tokens, not a sample, since such a change can sit anywhere; ids hashed as uint32 (a
        shard's width does not matter) with each shard's window count and the window length, so
        equal digests mean equal windows. About 1 s per 100M tokens on a slow core."""
        from hydra_train.dataset import as_view

        view = as_view(self.train)
        t = view.seq_len
        h = hashlib.sha1(f"T={t}|".encode())
        i, n = 0, view.num_windows
        while i < n:
            shard, j = view.locate(i)  # windows j, j+1, ... of this shard
            in_shard = shard.tokens.shape[0] if shard.is_rows else (shard.num_tokens - 1) // t
            count = min(n - i, in_shard - j)
            if count <= 0:  # locate skips shards without windows; a zero here would loop forever
                raise DiagError(f"{shard.path}: window {i} is not in its shard")
            part = shard.tokens[j : j + count] if shard.is_rows else shard.tokens[j * t : (j + count) * t + 1]
            flat = part.reshape(-1)
            h.update(f"{count}|".encode())
            try:
                for k in range(0, flat.size, DIGEST_CHUNK):
                    h.update(np.ascontiguousarray(flat[k : k + DIGEST_CHUNK], dtype="<u4"))
            except OSError as exc:  # a memory-mapped shard that vanished or failed to read
                raise DiagError(f"{shard.path}: unreadable shard ({exc})") from None
            i += count
        return h.hexdigest()[:16]

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation windows in batches of at most ``batch_size``, their ids checked
        against the vocabulary on the host as training batches are (BatchPlan.batch): on CUDA an id
        past the embedding is a device-side assert, which would fail every later entrant too.
        Built and checked once (load_race_data asks first); each entrant gets the same batches."""
        from hydra_train.dataset import as_view, check_token_range

        if self._val_batches is not None:
            return list(self._val_batches)
        view = as_view(self.val)
        out = []
        for i in range(0, len(self.val_ids), self.batch_size):
            ids = self.val_ids[i : i + self.batch_size]
            rows = np.stack([view.window(j) for j in ids])
            check_token_range(rows, view, ids)
            t = torch.from_numpy(rows)
            out.append((t[:, :-1], t[:, 1:]))
        self._val_batches = out
        return list(out)


def corpus_tree_roots(paths: list[Path]) -> list[tuple[str, Path]]:
    """``--corpus-root`` folders as (label, folder): the word ``env`` stands for the interpreter's
    own library and package folders; any other folder's files are keyed under its name."""
    from hydra_train.pyenv_corpus import environment_roots

    roots: list[tuple[str, Path]] = []
    for p in paths:
        if str(p) == "env":
            roots += environment_roots()
        elif not Path(p).is_dir():
            raise DiagError(f"--corpus-root: no such folder {p}")
        else:
            roots.append((Path(p).resolve().name or "root", Path(p)))
    return roots


def check_vocab_size(dataset: str, vocab_size: int | None) -> int | None:
    """The vocabulary the flags decide before any data is read: pyenv's (--vocab-size, else 32000),
    refused (DiagUsageError) below what its byte-level BPE needs; another dataset's --vocab-size, or
    None when its own is only known once read."""
    if dataset != "pyenv":
        return vocab_size
    from hydra_train.tokenizer import MIN_VOCAB

    vocab = vocab_size or DEFAULT_VOCAB
    if vocab < MIN_VOCAB:
        raise DiagUsageError(
            f"--vocab-size {vocab} is too small for the pyenv corpus's byte-level BPE (min {MIN_VOCAB}: "
            "256 byte symbols, the end-of-document token and a few merges)"
        )
    return vocab


def load_race_data(
    dataset: str,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    val_windows: int,
    vocab_size: int | None,
    extensions: str | None = None,
    corpus_roots: list[Path] | None = None,
    progress: Progress = no_progress,
) -> RaceData:
    """``pyenv`` (the default; ``corpus_roots`` replaces the interpreter's folders), or anything
    hydra-train's ``--dataset`` takes (a folder of shards ...). ``vocab_size`` None: pyenv's 32000,
    another dataset's own (its tokenizer's or meta's, as hydra-train reads it), 32000 where it names
    none: an explicit 32000 would override shards tokenized with a larger vocabulary."""
    if dataset == "pyenv":
        from hydra_train.dataset import TokenDataset
        from hydra_train.pyenv_corpus import load_pyenv_corpus
        from hydra_train.shards import open_shard

        roots = corpus_tree_roots(corpus_roots) if corpus_roots else None
        corpus = load_pyenv_corpus(
            vocab_size=vocab_size or DEFAULT_VOCAB, extensions=extensions, roots=roots, log=progress
        )
        vocab = corpus.vocab_size
        train = TokenDataset([open_shard(corpus.train_path)], seq_len, vocab, name="pyenv:train")
        val = TokenDataset([open_shard(corpus.val_path)], seq_len, vocab, name="pyenv:val")
        summary = {"name": "pyenv", "description": corpus.describe(), **corpus.summary()}
    else:
        if extensions or corpus_roots:
            raise DiagError("--extensions and --corpus-root apply to --dataset pyenv only")
        from hydra_train.data_sources import load_data

        bundle = load_data(
            dataset, seq_len=seq_len, vocab_size=vocab_size, default_vocab=DEFAULT_VOCAB, log=progress
        )
        train, val, vocab = bundle.train, bundle.val, bundle.vocab_size
        if bundle.seq_len != seq_len:
            # row shards fix the window length (hydra-train trains at it too): tokens, FLOPs, epochs
            # and the entrants' max_seq_len must follow the windows the models really see
            progress(f"{dataset}: rows of {bundle.seq_len + 1} tokens: sequence length {bundle.seq_len}")
            seq_len = bundle.seq_len
        summary = {"name": dataset, "description": bundle.description, "cache_key": None}
    data = RaceData(train, val, vocab, seq_len, batch_size, seed, val_windows)
    data.val_batches()  # bad ids refused here, once, rather than by each entrant the runner starts
    if data.train_tokens > 1 << 28:  # seconds of reading and hashing: say what the wait is
        progress(f"hashing the training split ({data.train_tokens / 1e6:.0f}M tokens) for its digest")
    summary.update(
        train_windows=data.train_windows,
        train_tokens_windowed=data.train_tokens,
        val_windows_used=len(data.val_ids),
        val_digest=data.val_digest(),
        train_digest=data.train_digest(),
        vocab_size=vocab,
    )
    data.summary = summary
    return data
