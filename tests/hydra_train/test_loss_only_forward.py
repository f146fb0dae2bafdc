"""The training forward asks the model for its losses alone where the model can say so
(``return_logits=False``: hydra_train.step.loss_only_kwargs), and calls a model without the
keyword as before."""

from __future__ import annotations

import torch
from torch import nn

from hydra_model import build_model
from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training
from hydra_train.step import loss_only_kwargs

from .conftest import tiny_config


class _NoKeyword(nn.Module):
    def forward(self, x, targets=None):
        return x


class _Opaque(nn.Module):
    def forward(self, *args, **kwargs):
        return args


def test_hydra_and_the_gpt_are_asked_for_their_losses_alone():
    for arch in ("hydra", "gpt"):
        assert loss_only_kwargs(build_model(arch, "debug")) == {"return_logits": False}, arch


def test_a_model_without_the_keyword_is_called_as_before():
    assert loss_only_kwargs(_NoKeyword()) == {}
    assert loss_only_kwargs(_Opaque()) == {}  # **kwargs might drop it, or pass it on: not guessed


class _SpyForward(TrainerCallback):
    """Wraps the trainer's training forward to record the keywords of each call."""

    name = "spy"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_train_start(self, trainer) -> None:
        inner = trainer.forward_model

        def forward(*args, **kwargs):
            self.calls.append(dict(kwargs))
            out = inner(*args, **kwargs)
            assert out.logits is None and torch.isfinite(out.loss)
            return out

        trainer.forward_model = forward


def test_the_training_step_passes_it(bin_dataset, tmp_path):
    spy = _SpyForward()
    summary = run_training(tiny_config(bin_dataset, tmp_path / "ck", max_steps=2), callbacks=[spy])
    assert summary["status"] == "finished"
    assert spy.calls and all(c == {"return_logits": False} for c in spy.calls)
