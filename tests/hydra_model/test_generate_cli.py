"""``hydra-model generate``: --threads, the stop at the tokenizer's end-of-text, tokens/s."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hydra_model.cli import app
from hydra_model.text_generation import end_of_text_id, timed_generate

from .conftest import small_model

runner = CliRunner()
PROMPT = [1, 2, 3]


def word_tokenizer(path, vocab_size: int, eos_at: int | None):
    """A word-level tokenizer over ``vocab_size`` made-up words: "the cat sat" is ids 1, 2, 3 and,
    when ``eos_at`` is given, that id is ``<|endoftext|>``."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab_size)]
    words[0], words[1], words[2], words[3] = "[UNK]", "the", "cat", "sat"
    if eos_at is not None:
        words[eos_at] = "<|endoftext|>"
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def free_run(model, n: int) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), n)[0, len(PROMPT) :].tolist()


def first_new_token_index(ids: list[int]) -> int:
    """An index k > 0 whose token appears neither earlier in ``ids`` nor in the prompt."""
    for k in range(1, len(ids)):
        if ids[k] not in ids[:k] and ids[k] not in PROMPT and ids[k] != 0:
            return k
    pytest.skip("the greedy continuation repeats itself; no token to make end-of-text")


def invoke(folder, *extra):
    args = ["generate", "--checkpoint", str(folder), "--prompt", "the cat sat", "--device", "cpu"]
    return runner.invoke(app, [*args, *extra])


def test_generation_stops_at_the_tokenizers_end_of_text(tmp_path):
    model = small_model()
    greedy = free_run(model, 12)
    k = first_new_token_index(greedy)
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(tmp_path / "m" / "tokenizer.json", model.config.vocab_size, eos_at=greedy[k])
    res = invoke(tmp_path / "m", "--max_new_tokens", "12", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["eos_token_id"] == greedy[k]
    assert data["generated_ids"] == greedy[:k]  # the same tokens up to, not including, end-of-text
    assert data["stopped_at_eos"] is True and data["tokens"] == k + 1
    assert "<|endoftext|>" not in data["text"]
    assert data["tokens_per_s"] == pytest.approx(data["tokens"] / data["seconds"])


def test_without_end_of_text_it_runs_to_max_new_tokens_and_prints_speed(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path / "m")
    tok = word_tokenizer(tmp_path / "m" / "tokenizer.json", model.config.vocab_size, eos_at=None)
    res = invoke(tmp_path / "m", "--max_new_tokens", "6")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("the cat sat")
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("6 tokens in ") and "tokens/s" in line and "reached --max_new_tokens" in line
    assert res.stdout.rstrip("\n") == "the cat sat" + tok.decode(free_run(model, 6))


def test_threads_sets_torch_threads(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(tmp_path / "m" / "tokenizer.json", model.config.vocab_size, eos_at=None)
    before = torch.get_num_threads()
    try:
        res = invoke(tmp_path / "m", "--max_new_tokens", "2", "--threads", "1", "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["threads"] == 1 == torch.get_num_threads()
        assert invoke(tmp_path / "m", "--threads", "0").exit_code == 2  # a usage error
    finally:
        torch.set_num_threads(before)


def test_end_of_text_lookup_and_timed_generate_agree_with_generate(tmp_path):
    tok = word_tokenizer(tmp_path / "t.json", 50, eos_at=7)
    assert end_of_text_id(tok) == 7
    assert end_of_text_id(word_tokenizer(tmp_path / "u.json", 50, eos_at=None)) is None
    model = small_model()
    out = timed_generate(model, PROMPT, 5)
    assert out.ids == free_run(model, 5) and not out.stopped_at_eos and out.produced == 5
