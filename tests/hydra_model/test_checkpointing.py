"""Gradient checkpointing reproduces loss and gradients exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from .conftest import random_tokens, small_model


def _loss_and_grads(model, x, y):
    model.zero_grad()
    out = model(x, targets=y)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model.routing_stats()


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("mode", [{}, {"moe_enabled": True, "moe_top_k": 2}, {"mor_routing": "token_choice"}])
def test_checkpointing_gives_the_same_loss_and_gradients(every, mode):
    base = small_model(**mode).train()
    ckpt = copy.deepcopy(base)
    ckpt.enable_gradient_checkpointing(every=every)
    assert ckpt.gradient_checkpointing
    x, y = random_tokens(2, 14), random_tokens(2, 14, seed=6)
    loss_a, grads_a, stats_a = _loss_and_grads(base, x, y)
    loss_b, grads_b, stats_b = _loss_and_grads(ckpt, x, y)
    torch.testing.assert_close(loss_b, loss_a, atol=0, rtol=0)
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, atol=1e-7, rtol=1e-6, msg=n)
    for a, b in zip(stats_a["mor"], stats_b["mor"], strict=True):
        torch.testing.assert_close(a["avg_depth"], b["avg_depth"])


def test_checkpointing_really_recomputes():
    """The checkpointed model runs its blocks again during backward (counted by a wrapper)."""
    model = small_model().train()
    model.enable_gradient_checkpointing(every=1)
    calls = []
    block_forward = model.blocks[1].forward

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return block_forward(*args, **kwargs)

    model.blocks[1].forward = counting_forward
    out = model(random_tokens(1, 9), targets=random_tokens(1, 9))
    assert len(calls) == 1
    out.loss.backward()
    assert len(calls) == 2
    model.disable_gradient_checkpointing()
    assert not model.gradient_checkpointing
    with pytest.raises(ValueError):
        model.enable_gradient_checkpointing(every=0)


def test_every_must_be_an_integer():
    """every=1.5 was taken as 1 (int()), checkpointing every block where the user asked for
    something else; an int of another type (numpy's) is still taken."""
    import numpy as np

    from hydra_model import build_model

    model = build_model("gpt", "tiny", dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64)
    with pytest.raises(TypeError, match=r"every=1\.5"):
        model.enable_gradient_checkpointing(every=1.5)
    assert not model.gradient_checkpointing
    n = int(np.random.default_rng().integers(1, 4))
    model.enable_gradient_checkpointing(every=np.int64(n))
    assert model._checkpoint_every == n and model.gradient_checkpointing
