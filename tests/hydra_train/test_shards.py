"""Shard formats: every reader against the data that was written, and one clear error per bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hydra_train.errors import HydraDataError
from hydra_train.shards import HEADER, open_shard, write_token_shard
from hydra_train.tokenizer import eos_id, train_bpe


def test_bin_roundtrip_uint16_and_uint32(tmp_path):
    rng = np.random.default_rng(0)
    small = rng.integers(0, 65535, size=1001)
    large = rng.integers(0, 200_000, size=777)
    for name, arr, width in (("a.bin", small, 2), ("b.bin", large, 4)):
        p = write_token_shard(tmp_path / name, torch.from_numpy(arr))
        assert p.stat().st_size == HEADER.size + arr.size * width
        s = open_shard(p)
        assert s.tokens.dtype.itemsize == width
        np.testing.assert_array_equal(np.asarray(s.tokens, dtype=np.int64), arr)
        assert s.max_token_id == int(arr.max())
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic writer left nothing behind


def test_headerless_bin_with_sidecar(tmp_path):
    arr = np.arange(10, 523, dtype=np.uint16)
    p = tmp_path / "raw.bin"
    p.write_bytes(b"\x00" * 16 + arr.tobytes())
    (tmp_path / "raw.bin.json").write_text(json.dumps({"dtype": "uint16", "header_bytes": 16}))
    s = open_shard(p)
    np.testing.assert_array_equal(np.asarray(s.tokens), arr)
    assert s.max_token_id is None  # unknown without a scan: checked per batch


def test_pt_formats(tmp_path):
    stream = torch.randint(0, 100, (257,))
    rows = torch.randint(0, 100, (5, 17))
    torch.save(stream, tmp_path / "s.pt")
    torch.save({"tokens": stream.int()}, tmp_path / "d.pt")
    torch.save({"input_ids": rows}, tmp_path / "r.pt")
    np.testing.assert_array_equal(open_shard(tmp_path / "s.pt").tokens, stream.numpy())
    np.testing.assert_array_equal(open_shard(tmp_path / "d.pt").tokens, stream.int().numpy())
    r = open_shard(tmp_path / "r.pt")
    assert r.is_rows and r.tokens.shape == (5, 17)


def test_jsonl_and_txt_are_tokenized_with_eos(tmp_path):
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 20, 300)
    eos = eos_id(tok)
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"text": "return x"}) + "\n\n" + json.dumps({"text": "def f"}) + "\n"
    )
    (tmp_path / "d.txt").write_text("return x")
    s = open_shard(tmp_path / "d.jsonl", tok)
    expected = [*tok.encode("return x").ids, eos, *tok.encode("def f").ids, eos]
    assert list(s.tokens) == expected
    assert list(open_shard(tmp_path / "d.txt", tok).tokens) == [*tok.encode("return x").ids, eos]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda d: write_token_shard(d / "t.bin", np.arange(100)).write_bytes(
                (d / "t.bin").read_bytes()[:-10]
            ),
            "truncated or corrupt",
        ),
        (lambda d: (d / "t.bin").write_bytes(b"garbage!" * 10), "no sidecar"),
        (lambda d: (d / "t.pt").write_bytes(b"not a zip file"), "unreadable .pt shard"),
        (lambda d: torch.save(torch.rand(10), d / "t.pt"), "must be integer"),
        (lambda d: torch.save({"x": torch.arange(3)}, d / "t.pt"), "'tokens'"),
        (lambda d: torch.save(torch.tensor([1, -2, 3]), d / "t.pt"), "negative token id"),
        (lambda d: (d / "t.jsonl").write_text('{"text": "a"}\n{oops\n'), "t.jsonl:2: not valid JSON"),
        (lambda d: (d / "t.jsonl").write_text('{"txt": "a"}\n'), "'text' string"),
        (lambda d: (d / "t.csv").write_text("1,2"), "unsupported data format '.csv'"),
    ],
)
def test_bad_shards_raise_one_clear_error(tmp_path, make, needle):
    make(tmp_path)
    path = next(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    with pytest.raises(HydraDataError) as ei:
        open_shard(path, tokenizer=None if path.suffix != ".jsonl" else train_bpe(["abc"] * 5, 300))
    msg = str(ei.value)
    assert str(path) in msg and needle in msg
    assert "\n" not in msg


def test_text_without_tokenizer_says_what_to_do(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(HydraDataError, match="--tokenizer"):
        open_shard(tmp_path / "a.txt")


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError):
        write_token_shard(tmp_path / "x.bin", np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        write_token_shard(tmp_path / "x.bin", np.array([5, 9]), max_token_id=8)


def test_writer_refuses_ids_wider_than_uint32(tmp_path):
    # 2**32 + 5 stored as uint32 would read back as 5: a wrong token, silently
    with pytest.raises(ValueError, match="4294967301"):
        write_token_shard(tmp_path / "x.bin", np.array([1, 2**32 + 5], dtype=np.int64))
    assert not (tmp_path / "x.bin").exists()
