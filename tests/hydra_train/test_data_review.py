"""Data pipeline review: short text files packed, left-out shards reported, .pt shards memory-mapped,
sidecar layouts checked against the file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_train.data_sources import load_data
from hydra_train.dataset import BatchPlan
from hydra_train.errors import HydraDataError
from hydra_train.shards import open_shard, open_shards, write_token_shard
from hydra_train.tokenizer import eos_id, train_bpe

WORDS = ["alpha", "beta", "gamma", "delta", "return", "yield", "lambda", "class", "def", "import"]


@pytest.fixture(scope="module")
def tok():
    return train_bpe([" ".join(WORDS)] * 40, 300)


def _random_text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(rng.choice(WORDS, size=n_words))


def _windows(stream: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Consecutive windows of seq_len + 1 tokens overlapping by one, computed independently."""
    out, start = [], 0
    while start + seq_len + 1 <= len(stream):
        out.append(stream[start : start + seq_len + 1])
        start += seq_len
    return out


def _all_windows(d) -> list[np.ndarray]:
    return [d.train.window(i) for i in range(d.train.num_windows)] + [
        d.val.window(i) for i in range(d.val.num_windows)
    ]


def test_short_txt_files_are_packed_into_windows(tmp_path, tok):
    # a folder of one-line files, each far shorter than a window: before, every file gave no window
    # and the run stopped with "empty dataset" (or, mixed with long files, lost them silently)
    rng = np.random.default_rng(7)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    texts = {f"doc{i:03d}.txt": _random_text(rng, int(rng.integers(1, 5))) for i in range(120)}
    for name in rng.permutation(list(texts)):  # written out of name order: the order is by name
        (tmp_path / name).write_text(texts[name])
    eos = eos_id(tok)
    stream = np.array(
        [t for name in sorted(texts) for t in [*tok.encode(texts[name]).ids, eos]], dtype=np.int64
    )
    seq_len = 16
    assert all(len(tok.encode(t).ids) + 1 < seq_len + 1 for t in texts.values())
    d = load_data(str(tmp_path), seq_len=seq_len, vocab_size=None, default_vocab=32000, log=lambda m: None)
    want = _windows(stream, seq_len)
    got = _all_windows(d)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # the same folder opened again gives the same batches (resume reads the windows by index)
    again = load_data(str(tmp_path), seq_len=seq_len, vocab_size=None, default_vocab=32000, log=print)
    p1, p2 = BatchPlan(d.train, 4, seed=3), BatchPlan(again.train, 4, seed=3)
    for k in (0, 5, 11):
        assert all(torch.equal(a, b) for a, b in zip(p1.batch(k), p2.batch(k), strict=True))


def test_text_files_between_bin_shards_keep_name_order(tmp_path, tok):
    # packing joins only neighbouring text files: a .bin shard between them keeps its place
    rng = np.random.default_rng(11)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    vocab = tok.get_vocab_size()
    eos = eos_id(tok)
    seq_len = 8
    a_txt = [_random_text(rng, 3) for _ in range(5)]
    b_bin = rng.integers(0, vocab, size=1 + seq_len * 6)
    c_txt = [_random_text(rng, 2) for _ in range(6)]
    for i, t in enumerate(a_txt):
        (tmp_path / f"a{i}.txt").write_text(t)
    write_token_shard(tmp_path / "b.bin", b_bin)
    for i, t in enumerate(c_txt):
        (tmp_path / f"c{i}.txt").write_text(t)

    def enc(texts):
        return np.array([t for x in texts for t in [*tok.encode(x).ids, eos]], dtype=np.int64)

    want = _windows(enc(a_txt), seq_len) + _windows(b_bin, seq_len) + _windows(enc(c_txt), seq_len)
    d = load_data(str(tmp_path), seq_len=seq_len, vocab_size=None, default_vocab=32000, log=print)
    got = _all_windows(d)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_shards_shorter_than_a_window_are_counted_and_reported(tmp_path):
    rng = np.random.default_rng(5)
    seq_len = 10
    sizes = [int(rng.integers(200, 400)), 7, int(rng.integers(200, 400)), 11, 3]
    for i, n in enumerate(sizes):
        write_token_shard(tmp_path / f"part{i}.bin", rng.integers(0, 50, size=n))
    val_sizes = [int(rng.integers(100, 200)), 4]
    for i, n in enumerate(val_sizes):
        write_token_shard(tmp_path / f"val_{i}.bin", rng.integers(0, 50, size=n))
    short = [n for n in sizes if n < seq_len + 1]
    logged: list[str] = []
    d = load_data(str(tmp_path), seq_len=seq_len, vocab_size=64, default_vocab=32000, log=logged.append)
    note = f"{len(short)} of {len(sizes)} shards ({sum(short)} tokens) are shorter than one window"
    val_note = f"1 of 2 shards ({val_sizes[1]} tokens) are shorter than one window"
    for want in (note, val_note):
        assert any(want in m for m in logged), logged
        assert want in d.description  # recorded with the run (run summary, database)
    for i in range(len(val_sizes)):
        (tmp_path / f"val_{i}.bin").unlink()
    # nothing left at all: the error says how much was there and what to do
    for i, n in enumerate(sizes):
        if n >= seq_len + 1:
            (tmp_path / f"part{i}.bin").unlink()
    with pytest.raises(HydraDataError, match=rf"{sum(short)} tokens in {len(short)} shard.*--seq_len"):
        load_data(str(tmp_path), seq_len=seq_len, vocab_size=64, default_vocab=32000, log=print)


def _mapped(path: Path) -> bool:
    return any(line.rstrip("\n").endswith(str(path)) for line in open("/proc/self/maps"))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_pt_shards_are_memory_mapped_not_read_whole(tmp_path):
    stream = torch.randint(0, 1000, (50_000,))
    rows = torch.randint(0, 1000, (40, 33), dtype=torch.int32)
    torch.save(stream, tmp_path / "s.pt")
    torch.save({"input_ids": rows}, tmp_path / "r.pt")
    s, r = open_shard(tmp_path / "s.pt"), open_shard(tmp_path / "r.pt")
    assert _mapped(tmp_path / "s.pt") and _mapped(tmp_path / "r.pt")
    np.testing.assert_array_equal(s.tokens, stream.numpy())
    np.testing.assert_array_equal(r.tokens, rows.numpy())
    assert (s.max_token_id, r.max_token_id) == (int(stream.max()), int(rows.max()))
    # a file in torch's legacy format cannot be mapped: read whole, and said so
    torch.save(stream, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = open_shard(tmp_path / "old.pt")
    np.testing.assert_array_equal(old.tokens, stream.numpy())
    assert any("old.pt" in str(w.message) and "legacy" in str(w.message) for w in caught)


@pytest.mark.parametrize("header_bytes", [-4, 64, 1_000])
def test_sidecar_header_outside_the_file_is_one_clear_error(tmp_path, header_bytes):
    # a sidecar meant for another file, or a shard replaced by a shorter one since
    rng = np.random.default_rng(header_bytes % 97)
    n = int(rng.integers(5, 20))
    p = tmp_path / "raw.bin"
    p.write_bytes(rng.integers(0, 100, size=n).astype(np.uint16).tobytes())
    (tmp_path / "raw.bin.json").write_text(json.dumps({"dtype": "uint16", "header_bytes": header_bytes}))
    with pytest.raises(HydraDataError) as ei:
        open_shard(p)
    msg = str(ei.value)
    assert "raw.bin" in msg and f"header_bytes {header_bytes}" in msg and f"{2 * n} bytes" in msg


def test_tokenizing_a_text_folder_shows_progress(tmp_path, tok, monkeypatch):
    import hydra_train.shards as shards

    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.0, raising=False)  # a line per encoded batch
    monkeypatch.setattr(shards, "ENCODE_BATCH_CHARS", 50, raising=False)
    rng = np.random.default_rng(2)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    n = 12
    for i in range(n):
        (tmp_path / f"f{i:02d}.txt").write_text(_random_text(rng, 20))
    logged: list[str] = []
    load_data(str(tmp_path), seq_len=8, vocab_size=None, default_vocab=32000, log=logged.append)
    counts = [int(m.split(": ")[1].split("/")[0]) for m in logged if m.startswith("tokenizing text:")]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[-1] == n, logged
    assert all(f"/{n} files" in m for m in logged if m.startswith("tokenizing text:"))


def test_val_folder_beside_top_level_shards_is_the_validation_data(tmp_path):
    # data/*.bin with data/val/*.bin: the val/ folder was ignored (no train/ folder beside it) and
    # the last 1% of the training windows held out instead
    rng = np.random.default_rng(9)
    seq_len = 9
    train_arrays = [rng.integers(0, 50, size=int(rng.integers(300, 500))) for _ in range(2)]
    val_array = rng.integers(0, 50, size=int(rng.integers(100, 200)))
    for i, arr in enumerate(train_arrays):
        write_token_shard(tmp_path / f"part{i}.bin", arr)
    write_token_shard(tmp_path / "val" / "part0.bin", val_array)
    d = load_data(str(tmp_path), seq_len=seq_len, vocab_size=64, default_vocab=32000, log=print)
    want_train = [w for arr in train_arrays for w in _windows(arr, seq_len)]
    want_val = _windows(val_array, seq_len)
    assert (d.train.num_windows, d.val.num_windows) == (len(want_train), len(want_val))
    for i, w in enumerate(want_train):
        np.testing.assert_array_equal(d.train.window(i), w)
    for i, w in enumerate(want_val):
        np.testing.assert_array_equal(d.val.window(i), w)


def test_too_little_data_to_hold_out_validation_says_what_to_do(tmp_path):
    seq_len = int(np.random.default_rng(4).integers(5, 30))
    write_token_shard(tmp_path / "a.bin", np.arange(seq_len + 1) % 50)  # exactly one window
    with pytest.raises(HydraDataError, match=r"1 windows are too few.*--seq_len.*val/"):
        load_data(str(tmp_path), seq_len=seq_len, vocab_size=64, default_vocab=32000, log=print)


def test_hidden_files_are_not_shards(tmp_path):
    # macOS writes "._name" AppleDouble files beside every file it copies to other disks; they are
    # hidden, so an error about (or training on) one would be about a file the user cannot see
    rng = np.random.default_rng(13)
    arr = rng.integers(0, 50, size=int(rng.integers(300, 600)))
    write_token_shard(tmp_path / "part0.bin", arr)
    (tmp_path / "._part0.bin").write_bytes(rng.bytes(4096))
    d = load_data(str(tmp_path), seq_len=9, vocab_size=64, default_vocab=32000, log=print)
    want = _windows(arr, 9)
    assert d.train.num_windows + d.val.num_windows == len(want)


class _WideTokenizer:
    """Ids above 65535 (a 100K vocabulary): one id per character, offset past uint16."""

    def __init__(self, base: int):
        self.base = base

    def token_to_id(self, name: str) -> int | None:
        return 1 if name == "<|endoftext|>" else None

    def id_to_token(self, i: int) -> str | None:
        return "<|endoftext|>" if i == 1 else None

    def get_vocab_size(self) -> int:
        return self.base + 256

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = False) -> list:
        return [type("E", (), {"ids": [self.base + ord(c) for c in t]})() for t in texts]

    encode_batch = encode_batch_fast


def test_packed_text_keeps_ids_above_uint16(tmp_path):
    rng = np.random.default_rng(17)
    texts = ["".join(rng.choice(list("abcdefgh"), size=int(rng.integers(1, 6)))) for _ in range(9)]
    for i, t in enumerate(texts):
        (tmp_path / f"t{i}.txt").write_text(t)
    for base in (2, 65_530):  # every id fits uint16 / some ids do not
        tok = _WideTokenizer(base)
        (shard,) = open_shards(sorted(tmp_path.glob("*.txt")), tok)
        want = [i for t in texts for i in [*(base + ord(c) for c in t), 1]]
        assert np.asarray(shard.tokens, dtype=np.int64).tolist() == want
        assert shard.max_token_id == max(want)
