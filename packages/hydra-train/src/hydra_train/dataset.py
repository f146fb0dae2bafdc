"""Windows over token shards, and the deterministic batch order that makes resume exact.

A :class:`TokenDataset` is a list of shards cut into *windows* of ``seq_len + 1`` tokens
(stream shards: consecutive, non-overlapping windows that never cross a shard boundary; row
shards: one window per row). A shard shorter than one window gives none: such shards are counted
(``short_shards``, reported by :mod:`hydra_train.data_sources`); text files are packed together
first (:func:`hydra_train.shards.open_shards`), so short documents are used.
Window ``w`` gives ``input = tokens[:-1]``, ``target = tokens[1:]``.

Batch order (:class:`BatchPlan`): training draws *sample positions* 0, 1, 2, ... ; position ``p``
is window ``perm_e[p mod N]`` of epoch ``e = p div N``, where ``perm_e`` is a permutation seeded by
``(seed, e)``. Batch ``k`` of the run covers positions ``[k·B·W, (k+1)·B·W)`` (micro-batch size
``B``, world size ``W``) and rank ``r`` takes the ``r``-th slice of ``B``. So each rank sees
different data, the ranks together see exactly what one process with batch ``B·W`` sees, and a
checkpoint only needs ``k`` (the number of micro-batches consumed) to continue where it stopped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hydra_train.errors import HydraDataError, short_error
from hydra_train.shards import Shard


class TokenDataset:
    """Shards cut into windows; ``window(i)`` returns ``seq_len + 1`` token ids as int64."""

    def __init__(self, shards: list[Shard], seq_len: int, vocab_size: int, name: str = "dataset"):
        if not shards:
            raise HydraDataError(f"{name}: no shards (empty dataset)")
        kinds = {s.is_rows for s in shards}
        if len(kinds) > 1:
            raise HydraDataError(f"{name}: mixes stream shards and row shards ({shards[0].path.parent})")
        self.name = name
        self.shards = shards
        self.vocab_size = int(vocab_size)
        #: the model's vocabulary when smaller than the data's (check_vocab_size): the ids a batch
        #: may hold; vocab_size stays the data's, which checkpoints record
        self.model_vocab_size: int | None = None
        self.is_rows = shards[0].is_rows
        if self.is_rows:
            lengths = {s.tokens.shape[1] for s in shards}
            if len(lengths) > 1:
                raise HydraDataError(f"{name}: row shards have different row lengths {sorted(lengths)}")
            seq_len = lengths.pop() - 1  # rows fix the sequence length
        self.seq_len = int(seq_len)
        counts = []
        for s in shards:
            if s.max_token_id is not None and s.max_token_id >= self.vocab_size:
                raise HydraDataError(
                    f"{s.path}: token id {s.max_token_id} >= vocab size {self.vocab_size}; the data was "
                    "tokenized with a larger vocabulary (pass --vocab_size or the matching --tokenizer)"
                )
            counts.append(s.tokens.shape[0] if self.is_rows else max(0, (s.num_tokens - 1) // self.seq_len))
        self._cum = np.cumsum([0, *counts])
        #: shards that give no window (shorter than seq_len + 1 tokens): left out, and reported
        self.short_shards = [s for s, c in zip(shards, counts, strict=True) if c == 0]
        if self.num_windows == 0:
            total = sum(s.num_tokens for s in shards)
            hint = "" if self.is_rows else "; use a smaller --seq_len or more data"
            raise HydraDataError(
                f"{name}: empty dataset: {total} tokens in {sum(s.files for s in shards)} shard(s) "
                f"({shards[0].path}{', ...' if len(shards) > 1 else ''}) give no window of "
                f"{self.seq_len + 1} tokens{hint}"
            )

    @property
    def num_windows(self) -> int:
        return int(self._cum[-1])

    @property
    def num_tokens(self) -> int:
        return self.num_windows * self.seq_len

    def short_shards_note(self) -> str | None:
        """What the shards too short for one window leave out, or None when every shard is used."""
        if not self.short_shards:
            return None
        tokens = sum(s.num_tokens for s in self.short_shards)
        short, files = sum(s.files for s in self.short_shards), sum(s.files for s in self.shards)
        return (
            f"{short} of {files} shards ({tokens} tokens) are shorter than "
            f"one window of {self.seq_len + 1} tokens and are not used"
        )

    def check_max_seq_len(self, max_seq_len: int) -> None:
        if self.seq_len > max_seq_len:
            where = self.shards[0].path if self.is_rows else self.name
            # rows fix their length; a stream's windows are --seq_len long
            fix = "" if self.is_rows else f"pass --seq_len {max_seq_len} or less, or "
            raise HydraDataError(
                f"{where}: sequences of {self.seq_len} tokens are longer than the model's max_seq_len "
                f"{max_seq_len}; {fix}give the model more positions with --model_override "
                f"max_seq_len={self.seq_len}"
            )

    def check_vocab_size(self, model_vocab_size: int) -> None:
        """Batches must fit the model's embedding, not only the data's vocabulary: the model's can
        be smaller (``--model_override vocab_size=N`` wins over the data's), and on CUDA an id
        past it is a device-side assert. A shard whose largest id is recorded is refused now;
        the others are checked per batch (check_token_range) against the smaller vocabulary."""
        model_vocab_size = int(model_vocab_size)
        if model_vocab_size >= self.vocab_size:
            self.model_vocab_size = None  # the data's own check is the stricter one
            return
        for s in self.shards:
            if s.max_token_id is not None and s.max_token_id >= model_vocab_size:
                raise HydraDataError(
                    f"{s.path}: token id {s.max_token_id} is outside the model's vocabulary "
                    f"[0, {model_vocab_size}) (the data's is {self.vocab_size}); "
                    + _vocab_hint(model_vocab_size)
                )
        self.model_vocab_size = model_vocab_size

    @property
    def id_limit(self) -> int:
        """The ids a batch may hold lie in ``[0, id_limit)``."""
        return self.vocab_size if self.model_vocab_size is None else self.model_vocab_size

    def locate(self, i: int) -> tuple[Shard, int]:
        k = int(np.searchsorted(self._cum, i, side="right")) - 1
        return self.shards[k], i - int(self._cum[k])

    def window(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} out of range [0, {self.num_windows})")
        shard, j = self.locate(i)
        if self.is_rows:
            arr = shard.tokens[j]
        else:
            arr = shard.tokens[j * self.seq_len : j * self.seq_len + self.seq_len + 1]
        try:
            return np.asarray(arr, dtype=np.int64)
        except OSError as exc:  # a memory-mapped file that vanished or failed to read
            raise HydraDataError(f"{shard.path}: unreadable shard ({short_error(exc)})") from None

    def split_tail(self, n_tail: int) -> tuple[WindowView, WindowView]:
        """(head, tail): the last ``n_tail`` windows held out (for validation)."""
        n = self.num_windows
        if not 0 < n_tail < n:
            raise HydraDataError(
                f"{self.name}: {n} windows are too few to hold out {n_tail} for validation; use a smaller "
                "--seq_len, more data, or validation data of its own (a val/ folder, or a validation split)"
            )
        return WindowView(self, 0, n - n_tail), WindowView(self, n - n_tail, n)


@dataclass
class WindowView:
    """A contiguous range of a dataset's windows, addressed from 0."""

    base: TokenDataset
    start: int
    stop: int

    @property
    def num_windows(self) -> int:
        return self.stop - self.start

    @property
    def seq_len(self) -> int:
        return self.base.seq_len

    @property
    def name(self) -> str:
        return self.base.name

    def window(self, i: int) -> np.ndarray:
        return self.base.window(self.start + i)

    def locate(self, i: int) -> tuple[Shard, int]:
        return self.base.locate(self.start + i)

    def check_max_seq_len(self, max_seq_len: int) -> None:
        self.base.check_max_seq_len(max_seq_len)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def id_limit(self) -> int:
        return self.base.id_limit

    def check_vocab_size(self, model_vocab_size: int) -> None:
        self.base.check_vocab_size(model_vocab_size)


def as_view(ds: TokenDataset | WindowView) -> WindowView:
    return ds if isinstance(ds, WindowView) else WindowView(ds, 0, ds.num_windows)


class BatchPlan:
    """Which windows micro-batch ``k`` of rank ``rank`` holds (see the module docstring)."""

    def __init__(
        self,
        data: TokenDataset | WindowView,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ):
        self.data = as_view(data)
        self.batch_size = int(batch_size)
        self.seed, self.rank, self.world_size, self.shuffle = int(seed), int(rank), int(world_size), shuffle
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()
        # prefetch threads share this plan: unguarded, concurrent evictions raise KeyError
        self._perms_lock = threading.Lock()

    def _perm(self, epoch: int) -> torch.Tensor:
        with self._perms_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                s = self.seed * 1_000_003 + epoch
                if not -(2**63) <= s < 2**64:
                    # torch seeds are 64-bit; a large --seed (torch.manual_seed takes any < 2**64)
                    # would overflow here. Only such seeds are folded: smaller ones keep their order
                    s %= 2**64
                g = torch.Generator().manual_seed(s)
                perm = torch.randperm(self.data.num_windows, generator=g)
                self._perms[epoch] = perm
                while len(self._perms) > 2:  # a batch spans at most two epochs
                    self._perms.popitem(last=False)
            return perm

    def window_ids(self, k: int) -> list[int]:
        n = self.data.num_windows
        first = (k * self.world_size + self.rank) * self.batch_size
        ids = []
        for p in range(first, first + self.batch_size):
            epoch, within = divmod(p, n)
            ids.append(int(self._perm(epoch)[within]) if self.shuffle else within)
        return ids

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, targets)``, both ``[B, seq_len]`` int64 on the CPU, ids checked against vocab."""
        ids = self.window_ids(k)
        rows = np.stack([self.data.window(i) for i in ids])  # [B, S+1]
        check_token_range(rows, self.data, ids)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


def check_token_range(rows: np.ndarray, data: WindowView, ids: list[int]) -> None:
    """One cheap max per batch, on the host before the copy to the device (an id past the
    embedding is a device-side assert there); on failure, name the shard and window that hold it."""
    vocab = data.id_limit
    if rows.size and (int(rows.max()) >= vocab or int(rows.min()) < 0):
        bad_row = int(np.argmax((rows >= vocab).any(axis=1) | (rows < 0).any(axis=1)))
        shard, j = data.locate(ids[bad_row])
        bad = rows[bad_row][(rows[bad_row] >= vocab) | (rows[bad_row] < 0)][0]
        if vocab < data.vocab_size:
            where = f"the model's vocabulary [0, {vocab}) (the data's is {data.vocab_size})"
            hint = _vocab_hint(vocab)
        else:
            where = f"the vocabulary [0, {vocab})"
            hint = (
                "the data was tokenized with another vocabulary (pass --vocab_size or the matching "
                "--tokenizer, or re-tokenize the data with the model's tokenizer)"
            )
        raise HydraDataError(f"{shard.path}: token id {int(bad)} (window {j}) is outside {where}; {hint}")


def _vocab_hint(model_vocab_size: int) -> str:
    return (
        f"the model's embedding has only {model_vocab_size} rows: give the model the data's vocabulary "
        "(no --model_override vocab_size below it) or re-tokenize the data with the model's tokenizer"
    )


def eval_batches(
    data: TokenDataset | WindowView, batch_size: int, n_batches: int, *, rank: int = 0, world_size: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches: the first windows in order, split across ranks."""
    view = as_view(data)
    total = min(view.num_windows, batch_size * n_batches * world_size)
    total -= total % world_size  # equal batch counts on every rank (FSDP forwards are collective)
    if total == 0:
        raise HydraDataError(f"{view.name}: the validation split has fewer windows than ranks")
    mine = list(range(rank, total, world_size))
    out = []
    for i in range(0, len(mine), batch_size):
        ids = mine[i : i + batch_size]
        rows = np.stack([view.window(j) for j in ids])
        check_token_range(rows, view, ids)
        t = torch.from_numpy(rows)
        out.append((t[:, :-1], t[:, 1:]))
    return out
