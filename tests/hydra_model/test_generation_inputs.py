"""generate's inputs and its effect on the model: bad prompts and sampling settings raise a
ValueError naming them before anything runs; every module's train/eval flag comes back as it was;
a tiny temperature and top_p = 1 sample as their limits say."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from hydra_model import generation
from hydra_model.cli import app

from .conftest import random_tokens, small_model
from .test_generate_cli import word_tokenizer


def test_each_modules_train_flag_comes_back():
    model = small_model().train()
    model.blocks[0].eval()  # a frozen block of a model in training
    model.generate(random_tokens(1, 4), 3)
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    model.eval()
    model.blocks[1].train()  # a block trained on its own while the model evaluates
    model.generate(random_tokens(1, 4), 3)
    assert not model.training and model.blocks[1].training and not model.blocks[0].training


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (torch.zeros(0, 5, dtype=torch.long), "B ≥ 1"),
        (torch.zeros(2, 0, dtype=torch.long), "S ≥ 1"),
        (torch.zeros(2, 3), "token ids"),
        (torch.tensor([[1, 2, 97]]), "vocabulary is 0..96"),
        (torch.tensor([[1, -1, 2]]), "vocabulary is 0..96"),
    ],
)
def test_a_bad_prompt_is_named(prompt, match):
    model = small_model()
    assert model.config.vocab_size == 97
    with pytest.raises(ValueError, match=match):
        model.generate(prompt, 2)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
    ],
)
def test_a_bad_sampling_setting_is_named_before_the_prefill(setting, match, monkeypatch):
    model = small_model()
    ran = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match=match):
        model.generate(random_tokens(1, 4), 2, **setting)
    assert not ran


def test_a_tiny_temperature_samples_the_argmax():
    logits = torch.randn(16, 97) * 5
    gen = torch.Generator().manual_seed(3)
    for temperature in (1e-45, 1e-30):  # logits / T overflow to inf: NaN probabilities before
        got = generation.sample_next(logits, temperature, generator=gen)
        assert torch.equal(got, logits.argmax(-1))


def test_top_p_one_keeps_every_token(monkeypatch):
    """A sharply peaked distribution: fp32 cumulative sums reach 1 before its tail, which a
    nucleus of 1 dropped (probabilities of the tail set to 0)."""
    logits = torch.cat([torch.tensor([[30.0]]), torch.full((1, 5000), -5.0)], dim=1)
    seen = []
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **k: seen.append(p) or real(p, *a, **k))
    generation.sample_next(logits, 1.0, top_p=1.0)
    assert bool((seen[0] > 0).all())


def test_the_cli_refuses_top_p_zero_as_a_usage_error(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(tmp_path / "m" / "tokenizer.json", model.config.vocab_size, eos_at=None)
    args = ["generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "the cat", "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--temperature", "1", "--top-p", "0"])
    assert res.exit_code == 2 and "--top-p must be > 0" in res.output
