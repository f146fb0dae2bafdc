"""The corpus tokenizer: trained once, then loaded from the cache; documents end with EOS."""

from __future__ import annotations

import numpy as np
import pytest

from hydra_train.corpus import Corpus, CorpusDoc
from hydra_train.errors import HydraDataError
from hydra_train.tokenizer import (
    EOS_TOKEN,
    cached_corpus_tokenizer,
    encode_documents,
    eos_id,
    load_tokenizer,
    train_bpe,
)


def _corpus(fp="abc"):
    docs = [CorpusDoc(f"m{i}.py", f"def function_{i}(arg):\n    return arg * {i}\n" * 5) for i in range(40)]
    return Corpus("stdlib", None, docs[:35], docs[35:], fp)


def test_cache_hit_returns_the_same_tokenizer(tmp_path):
    logs = []
    tok1, path1, hit1 = cached_corpus_tokenizer(_corpus(), 400, tmp_path, log=logs.append)
    tok2, path2, hit2 = cached_corpus_tokenizer(_corpus(), 400, tmp_path, log=logs.append)
    assert (hit1, hit2) == (False, True) and path1 == path2
    assert path1.name == "stdlib-abc-v400.json"
    assert tok1.get_vocab() == tok2.get_vocab()
    assert sum("training" in m for m in logs) == 1
    _, path3, hit3 = cached_corpus_tokenizer(_corpus("other"), 400, tmp_path, log=logs.append)
    assert not hit3 and path3 != path1  # another corpus fingerprint is another cache entry
    path1.write_text("{broken")
    _, _, hit4 = cached_corpus_tokenizer(_corpus(), 400, tmp_path, log=logs.append)
    assert not hit4 and any("unreadable" in m for m in logs)


def test_encode_documents_appends_eos_and_roundtrips():
    tok = train_bpe([d.text for d in _corpus().train], 350)
    assert tok.token_to_id(EOS_TOKEN) == 0 == eos_id(tok)
    texts = ["return arg * 3\n", "déf ünïcode → ok"]
    ids = encode_documents(tok, texts, batch=1)
    assert ids.dtype == np.uint32
    parts = np.split(ids, np.where(ids == 0)[0] + 1)[:-1]
    assert [tok.decode(list(p[:-1])) for p in parts] == texts


def test_bad_inputs(tmp_path):
    with pytest.raises(HydraDataError, match="too small"):
        train_bpe(["x"], 100)
    with pytest.raises(HydraDataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HydraDataError, match=r"bad\.json could not be read"):
        load_tokenizer(tmp_path / "bad.json")


def test_tokenizer_folder_is_not_reported_missing(tmp_path):
    # a Hugging Face model folder passed as --tokenizer exists: say what to pass instead
    (tmp_path / "model").mkdir()
    with pytest.raises(HydraDataError, match=r"model is a folder, not a tokenizer\.json file") as ei:
        load_tokenizer(tmp_path / "model")
    assert "does not exist" not in str(ei.value)
