"""convert.py: JSONL text and chat → shards that hydra-train reads back to the same text."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hydra_diag.convert import render_chat
from hydra_diag.output import DiagError
from hydra_train.data_sources import load_data
from hydra_train.tokenizer import load_tokenizer, train_bpe

from .conftest import invoke, last_error_line, run_json

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    rng = random.Random(0)
    texts = [
        f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for i in range(150)
    ]
    tok = train_bpe(texts, 400)
    (root / "tokenizer.json").write_text(tok.to_str())
    with open(root / "a.jsonl", "w") as f:
        for t in texts[:100]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    with open(root / "b.jsonl", "w") as f:
        for t in texts[100:]:
            f.write(json.dumps({"text": t}) + "\n\n")  # blank lines are skipped
    return root, texts


def _decode_stream(folder, tok) -> str:
    parts = []
    for f in sorted(folder.glob("part*.pt")):
        obj = torch.load(f, weights_only=True)
        ids = obj["tokens"] if "tokens" in obj else obj["input_ids"].reshape(-1)
        parts.append(tok.decode(ids.tolist()))
    return "".join(parts)


def test_jsonl_to_stream_shards_round_trip(runner, corpus, tmp_path):
    root, texts = corpus
    out = run_json(
        runner,
        [
            "convert",
            "jsonl-to-pt",
            root,
            "--out",
            tmp_path / "s",
            "--tokenizer",
            root / "tokenizer.json",
            "--tokens_per_shard",
            700,
        ],
    )
    train = out["splits"]["train"]
    assert train["documents"] == 150 and train["shards"] >= 3 and out["vocab_size"] == 400
    tok = load_tokenizer(root / "tokenizer.json")
    assert _decode_stream(tmp_path / "s", tok) == "".join(texts)  # decode drops the end-of-document id
    assert (tmp_path / "s" / "tokenizer.json").is_file() and json.loads(
        (tmp_path / "s" / "meta.json").read_text()
    )
    data = load_data(str(tmp_path / "s"), seq_len=16, vocab_size=None, default_vocab=32000)
    assert data.vocab_size == 400  # hydra-train found the copied tokenizer
    assert data.train.num_windows > 0


def test_rows_layout_and_validation_split(runner, corpus, tmp_path):
    root, _ = corpus
    out = run_json(
        runner,
        [
            "convert",
            "jsonl-to-pt",
            root / "a.jsonl",
            "--out",
            tmp_path / "r",
            "--tokenizer",
            root / "tokenizer.json",
            "--layout",
            "rows",
            "--seq_len",
            31,
            "--val_fraction",
            0.3,
        ],
    )
    tr, va = out["splits"]["train"], out["splits"]["val"]
    assert tr["documents"] + va["documents"] == 100 and 10 < va["documents"] < 50
    rows = torch.load(tr["files"][0], weights_only=True)["input_ids"]
    assert rows.shape[1] == 32 and rows.dtype == torch.int32
    assert tr["tokens"] % 32 == 0 and tr["dropped_tokens"] < 32
    data = load_data(str(tmp_path / "r"), seq_len=999, vocab_size=None, default_vocab=32000)
    assert data.seq_len == 31  # row shards fix the sequence length


def test_chat_template_and_both_input_shapes(runner, corpus, tmp_path):
    root, _ = corpus
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "alpha beta"},
                        {"role": "assistant", "content": "gamma"},
                    ]
                }
            )
            + "\n"
        )
        f.write(
            json.dumps(
                {"conversations": [{"from": "human", "value": "delta"}, {"from": "gpt", "value": "eta"}]}
            )
            + "\n"
        )
    run_json(
        runner,
        ["convert", "chat-to-pt", chat, "--out", tmp_path / "c", "--tokenizer", root / "tokenizer.json"],
    )
    text = _decode_stream(tmp_path / "c", load_tokenizer(root / "tokenizer.json"))
    assert text == (
        "<|system|>\nbe brief\n<|user|>\nalpha beta\n<|assistant|>\ngamma\n"
        + "<|user|>\ndelta\n<|assistant|>\neta\n"
    )


def test_bad_inputs_are_one_line_errors(runner, corpus, tmp_path):
    root, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    res = invoke(
        runner,
        ["convert", "chat-to-pt", bad, "--out", tmp_path / "o", "--tokenizer", root / "tokenizer.json"],
    )
    assert res.exit_code == 1 and "bad.jsonl:1" in last_error_line(res) and "wizard" in last_error_line(res)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    res = invoke(
        runner,
        ["convert", "jsonl-to-pt", broken, "--out", tmp_path / "o2", "--tokenizer", root / "tokenizer.json"],
    )
    assert res.exit_code == 1 and "broken.jsonl:2" in last_error_line(res)
    with pytest.raises(DiagError):
        render_chat([{"role": "user", "content": None}])


def test_default_tokenizer_is_hydra_trains_cached_one(runner, corpus, tmp_path, monkeypatch):
    """Without --tokenizer, the BPE hydra-train keeps for its embedded corpus is used (found in its
    cache here, so the test does not train one)."""
    from hydra_train.corpus import load_stdlib_corpus

    root, _ = corpus
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    stdlib = load_stdlib_corpus("stdlib")
    cached = tmp_path / "cache" / "tokenizers" / f"{stdlib.name}-{stdlib.fingerprint}-v400.json"
    cached.parent.mkdir(parents=True)
    cached.write_text((root / "tokenizer.json").read_text())
    out = run_json(
        runner, ["convert", "jsonl-to-pt", root / "b.jsonl", "--out", tmp_path / "d", "--vocab_size", 400]
    )
    assert out["tokenizer"] == str(cached) and out["splits"]["train"]["documents"] == 50
