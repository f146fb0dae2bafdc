"""A cache folder ($HYDRA_CACHE_DIR) that cannot be written: refused before a tokenizer is trained,
and any failed cache write named with HYDRA_CACHE_DIR (not --checkpoint_dir, which moves nothing
of the cache)."""

from __future__ import annotations

import errno
import os

import pytest
from typer.testing import CliRunner

import hydra_train.tokenizer as tokenizer_mod
from hydra_train.cli import app
from hydra_train.corpus import Corpus, CorpusDoc
from hydra_train.errors import HydraDataError
from hydra_train.tokenizer import cached_corpus_tokenizer


def _corpus() -> Corpus:
    docs = [CorpusDoc(f"m{i}.py", f"def function_{i}(arg):\n    return arg * {i}\n" * 5) for i in range(40)]
    return Corpus("stdlib", None, docs[:35], docs[35:], "abc")


def _no_training(*a, **k):
    raise AssertionError("a tokenizer was trained although the cache cannot keep it")


def test_read_only_cache_is_refused_before_the_tokenizer_is_trained(tmp_path, monkeypatch):
    cache = tmp_path / "rocache"
    (cache / "tokenizers").mkdir(parents=True)
    real_access = os.access
    # as a read-only folder is for a user who is not root (root may write anywhere)
    monkeypatch.setattr(
        os, "access", lambda p, m: False if str(p).startswith(str(cache)) else real_access(p, m)
    )
    monkeypatch.setattr(tokenizer_mod, "train_bpe", _no_training)
    logs: list[str] = []
    with pytest.raises(HydraDataError) as exc:
        cached_corpus_tokenizer(_corpus(), 400, cache, log=logs.append)
    msg = str(exc.value)
    assert f"{cache / 'tokenizers'} is not writable" in msg and "HYDRA_CACHE_DIR" in msg
    assert "--checkpoint_dir" not in msg and not any("training" in m for m in logs)


def test_a_cache_write_that_fails_names_hydra_cache_dir(tmp_path, monkeypatch):
    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tokenizer_mod, "atomic_write_bytes", full_disk)
    with pytest.raises(HydraDataError) as exc:
        cached_corpus_tokenizer(_corpus(), 400, tmp_path, log=lambda m: None)
    msg = str(exc.value)
    assert msg.startswith(f"cannot write the cache: {tmp_path / 'tokenizers'}")
    assert "No space left on device; free disk space or set HYDRA_CACHE_DIR" in msg


def test_run_with_an_unusable_cache_dir_says_hydra_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder can be made
    monkeypatch.setattr(tokenizer_mod, "train_bpe", _no_training)
    args = ["run", "--device", "cpu", "--max_steps", "1", "--checkpoint_dir", str(tmp_path / "ck")]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert res.exit_code == 1, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error: cannot create the cache folder") and "set HYDRA_CACHE_DIR" in last
    assert "--checkpoint_dir" not in last and "training a byte-level BPE" not in res.output
