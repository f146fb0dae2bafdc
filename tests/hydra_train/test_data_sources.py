"""--dataset resolution: names under HYDRA_DATA_ROOT, paths, validation splits, vocab and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hydra_train.data_sources import load_data
from hydra_train.errors import HydraDataError
from hydra_train.shards import write_token_shard
from hydra_train.tokenizer import train_bpe


def test_named_dataset_with_train_and_val_folders(bin_dataset, monkeypatch):
    monkeypatch.setenv("HYDRA_DATA_ROOT", str(bin_dataset.parent))
    d = load_data("bigram", seq_len=32, vocab_size=None, default_vocab=320, log=lambda m: None)
    assert d.vocab_size == 320 and d.seq_len == 32
    assert d.train.num_windows == (5999 // 32) + (4999 // 32)
    assert d.val.num_windows == 2999 // 32


def test_val_named_shards_and_tail_holdout(tmp_path):
    rng = np.random.default_rng(0)
    write_token_shard(tmp_path / "a" / "train_000.bin", rng.integers(0, 50, 1000))
    write_token_shard(tmp_path / "a" / "valid_000.bin", rng.integers(0, 50, 300))
    d = load_data(str(tmp_path / "a"), seq_len=9, vocab_size=64, default_vocab=32000, log=print)
    assert (d.train.num_windows, d.val.num_windows) == (999 // 9, 299 // 9)
    write_token_shard(tmp_path / "b" / "only.bin", rng.integers(0, 50, 1 + 9 * 300))
    (tmp_path / "b" / "meta.json").write_text(json.dumps({"vocab_size": 77}))
    d = load_data(str(tmp_path / "b"), seq_len=9, vocab_size=None, default_vocab=32000, log=print)
    assert d.vocab_size == 77  # from meta.json
    assert (d.train.num_windows, d.val.num_windows) == (297, 3)  # 1% held out at the end
    np.testing.assert_array_equal(d.val.window(2), d.train.base.window(299))


def test_text_folder_uses_its_tokenizer(tmp_path):
    tok = train_bpe(["the quick brown fox jumps over the lazy dog\n"] * 50, 320)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    lines = [json.dumps({"text": f"the quick brown fox {i}"}) for i in range(200)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    d = load_data(str(tmp_path), seq_len=8, vocab_size=None, default_vocab=32000, log=print)
    assert d.vocab_size == tok.get_vocab_size()
    assert d.tokenizer_path == tmp_path / "tokenizer.json"
    assert d.train.num_windows > 0 and d.val.num_windows >= 1


def test_missing_and_empty_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_DATA_ROOT", str(tmp_path))
    with pytest.raises(HydraDataError, match=r"dataset 'nope' not found; looked for .*nope"):
        load_data("nope", seq_len=8, vocab_size=None, default_vocab=100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HydraDataError, match="empty folder; supported: "):
        load_data("empty", seq_len=8, vocab_size=None, default_vocab=100)


def test_train_folder_without_val_folder_holds_out_its_tail(tmp_path):
    # the layout the tokenizer trainer reads (text_tables.iter_texts): data/train/*.bin, no val/
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 50, n) for n in (1 + 9 * 150, 1 + 9 * 50)]
    for i, arr in enumerate(arrays):
        write_token_shard(tmp_path / "d" / "train" / f"part{i}.bin", arr)
    d = load_data(str(tmp_path / "d"), seq_len=9, vocab_size=64, default_vocab=32000, log=print)
    assert (d.train.num_windows, d.val.num_windows) == (198, 2)
    np.testing.assert_array_equal(d.val.window(1), arrays[1][-10:])  # the very last window
    np.testing.assert_array_equal(d.train.window(0), arrays[0][:10])


def test_only_validation_named_shards_say_so(tmp_path):
    write_token_shard(tmp_path / "d" / "validation.bin", np.arange(100) % 50)
    with pytest.raises(HydraDataError, match=r"validation\.bin.* named like validation"):
        load_data(str(tmp_path / "d"), seq_len=9, vocab_size=64, default_vocab=32000, log=print)
