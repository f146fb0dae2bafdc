"""``generate`` past the model's ``max_seq_len`` and with a tokenizer smaller than its vocabulary:
both ran without a word. Both run (RoPE's table grows with the same formula, and the tokenizer
may be one the vocabulary was padded past), with one warning on stderr before the generation."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hydra_model.cli import app

from .conftest import SMALL, small_model
from .test_generate_cli import word_tokenizer

runner = CliRunner()
MAX_SEQ_LEN, VOCAB = SMALL["max_seq_len"], SMALL["vocab_size"]


def saved(tmp_path):
    folder = tmp_path / "m"
    small_model(seed=4).save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", VOCAB, eos_at=None)
    return folder


def generate(folder, prompt: str, new: int, *extra: str):
    args = ["generate", "--checkpoint", str(folder), "--prompt", prompt, "--max-new-tokens", str(new)]
    return runner.invoke(app, [*args, "--device", "cpu", "--json", *extra])


def warnings(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("warning:")]


def test_past_max_seq_len_warns_once_and_generates(tmp_path):
    folder = saved(tmp_path)
    prompt = " ".join(["the cat sat"] * 20)  # 60 tokens
    res = generate(folder, prompt, MAX_SEQ_LEN - 60)  # 64 in all: within the training range
    assert res.exit_code == 0, res.output
    assert not warnings(res), res.stderr
    res = generate(folder, prompt, MAX_SEQ_LEN - 60 + 5)
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["generated_ids"]) == 9
    (line,) = warnings(res)
    assert f"{MAX_SEQ_LEN + 5} tokens" in line and f"max_seq_len {MAX_SEQ_LEN}" in line
    assert "--max-new-tokens" in line  # what to do


def test_help_says_what_happens_past_max_seq_len():
    res = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert "max_seq_len" in res.output


def test_an_explicit_tokenizer_smaller_than_the_vocabulary_warns(tmp_path):
    folder = saved(tmp_path)
    small = tmp_path / "small.json"
    word_tokenizer(small, 50, eos_at=None)
    res = generate(folder, "the cat sat", 4, "--tokenizer", str(small))
    assert res.exit_code == 0, res.output
    (line,) = warnings(res)
    assert str(small) in line and "50" in line and str(VOCAB) in line and "--tokenizer" in line
    # the tokenizer beside the checkpoint came with it (a vocabulary padded past it): no warning
    word_tokenizer(folder / "tokenizer.json", 50, eos_at=None)
    res = generate(folder, "the cat sat", 4)
    assert res.exit_code == 0 and not warnings(res), res.stderr
