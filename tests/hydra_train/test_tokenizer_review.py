"""Tokenizer edge cases a user meets: the end-of-text marker written inside a document, and
``hydra-train tokenizer train``'s errors about its output and its options."""

from __future__ import annotations

import json
import random

import numpy as np
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.tokenizer import EOS_TOKEN, encode_documents, eos_id, train_bpe

runner = CliRunner()
ALPHABET = "ab cd\n\t é→漢😀<|>"


def _random_texts(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def test_end_of_text_written_in_a_document_stays_text():
    # Python sources (transformers' tokenizers, in the pyenv corpus) and web text contain the
    # literal "<|endoftext|>": it must not become a document boundary nor vanish on decoding
    rng = random.Random()
    tok = train_bpe(_random_texts(rng, 200), 320)
    texts = _random_texts(rng, 30)
    for i in rng.sample(range(len(texts)), 10):
        cut = rng.randint(0, len(texts[i]))
        texts[i] = texts[i][:cut] + EOS_TOKEN + texts[i][cut:]
    ids = encode_documents(tok, texts, batch=7)
    ends = np.flatnonzero(ids == eos_id(tok))
    assert len(ends) == len(texts) and ends[-1] == ids.size - 1
    docs = np.split(ids, ends + 1)[:-1]
    assert [tok.decode(d[:-1].tolist(), skip_special_tokens=False) for d in docs] == texts


class _NoWrites:
    """The caller's tokenizer, refusing any attribute set: encode_documents flipped its
    encode_special_tokens for a moment, which another thread encoding with it then saw (its
    end-of-text ids lost)."""

    def __init__(self, tok):
        object.__setattr__(self, "_tok", tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"encode_documents set {name} on the caller's tokenizer")


def test_end_of_text_in_documents_leaves_the_callers_tokenizer_as_it_was():
    rng = random.Random()
    tok = train_bpe(_random_texts(rng, 200), 320)
    texts = [t + EOS_TOKEN + t for t in _random_texts(rng, 6)] + _random_texts(rng, 6)
    rng.shuffle(texts)
    got = encode_documents(_NoWrites(tok), texts, batch=5)
    assert np.array_equal(got, encode_documents(tok, texts, batch=5))
    assert tok.encode_special_tokens is False
    # the text's end-of-text string is still text, and a plain encode still matches the token
    assert (got == eos_id(tok)).sum() == len(texts)
    assert eos_id(tok) in tok.encode("a" + EOS_TOKEN + "b", add_special_tokens=False).ids


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def test_unwritable_out_is_an_error_naming_it_before_training(tmp_path, monkeypatch):
    import hydra_train.tokenizer as tokenizer_mod

    _jsonl(tmp_path / "d.jsonl", _random_texts(random.Random(), 20))
    (tmp_path / "afile").write_text("not a folder")
    trained = []

    def train(texts, vocab_size):
        trained.append(vocab_size)
        return train_bpe(texts, vocab_size)

    monkeypatch.setattr(tokenizer_mod, "train_bpe", train)
    out = tmp_path / "afile" / "tokenizer.json"
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", str(out)])
    line = " ".join(res.stderr.split())
    assert res.exit_code == 1 and line.startswith("error:") and str(tmp_path / "afile") in line, res.output
    assert not trained  # refused before spending the training time


def test_vocab_size_below_the_byte_alphabet_is_a_usage_error(tmp_path):
    _jsonl(tmp_path / "d.jsonl", ["some text"])
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path), "--vocab_size", "100"])
    assert res.exit_code == 2 and "--vocab" in res.output, res.output
    assert not (tmp_path / "tokenizer.json").exists()


def test_text_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    good = tmp_path / "a.jsonl"
    _jsonl(good, _random_texts(random.Random(), 5))
    latin = tmp_path / "b.jsonl"
    latin.write_bytes(json.dumps({"text": "caf"}).encode()[:-2] + b'\xe9"}\n')  # Latin-1 é
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path), "--out", str(tmp_path / "t.json")])
    line = " ".join(res.stderr.split())
    assert res.exit_code == 1 and line.startswith("error:") and str(latin) in line, res.output
    assert "UTF-8" in line and not (tmp_path / "t.json").exists()


def test_tokenizer_training_skips_hidden_files_as_the_run_does(tmp_path):
    """A folder copied from macOS holds ._name files (binary AppleDouble data): `hydra-train run`
    skips hidden files, but tokenizer training read them (a .jsonl one failed as not UTF-8, a .txt
    one fed replacement characters into the vocabulary)."""
    from hydra_train.text_tables import iter_texts

    rng = random.Random()
    texts = _random_texts(rng, 8)
    _jsonl(tmp_path / "data.jsonl", texts)
    (tmp_path / "._data.jsonl").write_bytes(bytes([0, 5, 22, 7, 0xFF, 0xFE]) + rng.randbytes(40))
    (tmp_path / ".notes.txt").write_text("hidden " + _random_texts(rng, 1)[0], encoding="utf-8")
    assert list(iter_texts([tmp_path])) == texts
