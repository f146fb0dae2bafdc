"""convert jsonl-to-pt / chat-to-pt where a user's data or output folder is not the tidy case: a
second conversion into the same folder, a conversion that fails part-way, malformed lines, and a
small validation share. Each check reads the shards back independently of convert.py."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import torch

from hydra_train.tokenizer import eos_id, load_tokenizer, train_bpe

from .conftest import invoke, last_error_line, run_json

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zêta", "→", "\n"]


def _texts(rng: random.Random, n: int, most: int = 12) -> list[str]:
    return [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most))) for i in range(n)]


def _setup(tmp_path, n: int = 60, most: int = 12):
    rng = random.Random()
    texts = _texts(rng, n, most)
    tok_file = tmp_path / "tok.json"
    tok_file.write_text(train_bpe(texts, 320).to_str())
    src = tmp_path / "src"
    src.mkdir()
    (src / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return texts, tok_file, src


def _documents(files, tok) -> list[str]:
    """The documents of stream shards, cut at the end-of-document id and decoded one by one."""
    ids = np.concatenate(
        [np.zeros(0, np.int32)] + [torch.load(f, weights_only=True)["tokens"].numpy() for f in files]
    )
    ends = np.flatnonzero(ids == eos_id(tok))
    return [tok.decode(d[:-1].tolist()) for d in np.split(ids, ends + 1)[:-1]]


def _data_files(out):
    """Every shard-like file hydra-train could read under ``out`` (the folder, train/, val/)."""
    return sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in (".pt", ".jsonl", ".bin"))


def _convert(runner, src, out, tok_file, *extra, code=0):
    args = ["convert", "jsonl-to-pt", src, "--out", out, "--tokenizer", tok_file, *extra]
    return run_json(runner, args, code) if code == 0 else invoke(runner, args)


def test_second_conversion_into_a_folder_replaces_the_first(runner, tmp_path):
    texts, tok_file, src = _setup(tmp_path)
    tok = load_tokenizer(tok_file)
    out = tmp_path / "out"
    _convert(runner, src, out, tok_file, "--tokens_per_shard", 50)  # many small shards
    _convert(runner, src, out, tok_file, "--tokens_per_shard", 100_000)  # one shard
    files = _data_files(out)
    assert [str(f) for f in files] == json.loads((out / "meta.json").read_text())["splits"]["train"]["files"]
    assert _documents(files, tok) == texts  # each document once: no shard of the first run is left
    # the layout with val/ and train/ and back: hydra-train would read train/ before the folder's shards
    meta = _convert(runner, src, out, tok_file, "--val_fraction", 0.5)
    assert not list(out.glob("part*.pt")) and meta["splits"]["val"]["documents"] > 0
    _convert(runner, src, out, tok_file)
    assert not (out / "train").exists() and not (out / "val").exists()
    assert _documents(_data_files(out), tok) == texts


def test_output_folder_holding_other_data_is_refused(runner, tmp_path):
    _, tok_file, src = _setup(tmp_path)
    before = {p: p.read_bytes() for p in src.iterdir()}
    res = _convert(runner, src, src, tok_file, code=1)  # --out is the input folder
    assert res.exit_code == 1 and "d.jsonl" in last_error_line(res), res.output
    assert {p: p.read_bytes() for p in src.iterdir()} == before  # no shard landed beside the text
    res = _convert(runner, src, src / "d.jsonl" / "out", tok_file, code=1)  # a file in the way
    assert res.exit_code == 1 and "d.jsonl" in last_error_line(res), res.output


def test_a_failed_conversion_leaves_the_earlier_output_whole(runner, tmp_path):
    _, tok_file, src = _setup(tmp_path, n=300, most=4)
    out = tmp_path / "out"
    _convert(runner, src, out, tok_file, "--tokens_per_shard", 40)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with open(src / "d.jsonl", "a") as f:  # a broken last line, after shards of this run are written
        f.write("{not json\n")
    res = _convert(runner, src, out, tok_file, "--tokens_per_shard", 30, code=1)
    assert res.exit_code == 1 and "d.jsonl:301" in last_error_line(res)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in out.iterdir() if p.is_dir()] == []  # no staging folder left behind


def test_malformed_chat_turns_and_undecodable_bytes_name_the_line(runner, tmp_path):
    _, tok_file, _ = _setup(tmp_path)
    lines = [
        {"messages": [{"role": "user", "content": "hi"}, "just text"]},
        {"conversations": [{"from": "human", "value": "hi"}, ["gpt", "hello"]]},
    ]
    for i, line in enumerate(lines):
        chat = tmp_path / f"chat{i}.jsonl"
        chat.write_text(json.dumps({"messages": []}) + "\n" + json.dumps(line) + "\n")
        res = invoke(
            runner, ["convert", "chat-to-pt", chat, "--out", tmp_path / f"c{i}", "--tokenizer", tok_file]
        )
        assert res.exit_code == 1 and f"chat{i}.jsonl:2" in last_error_line(res), res.output
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    res = _convert(runner, latin, tmp_path / "l", tok_file, code=1)
    assert res.exit_code == 1 and "latin.jsonl:2" in last_error_line(res), res.output
    assert "UTF-8" in last_error_line(res)


def test_a_small_validation_share_is_honoured(runner, tmp_path):
    texts, tok_file, src = _setup(tmp_path, n=3000, most=3)
    fraction = 0.003  # below 1/256: the first byte of the hash alone sent no document to val/
    out = tmp_path / "out"
    meta = _convert(runner, src, out, tok_file, "--val_fraction", fraction)
    # independent reference: sha1 read as a number in [0, 1)
    want_val = [t for t in texts if int(hashlib.sha1(t.encode()).hexdigest(), 16) / 2**160 < fraction]
    tok = load_tokenizer(tok_file)
    assert _documents(sorted((out / "val").glob("*.pt")), tok) == want_val
    assert _documents(sorted((out / "train").glob("*.pt")), tok) == [t for t in texts if t not in want_val]
    assert meta["splits"]["val"]["documents"] == len(want_val)
