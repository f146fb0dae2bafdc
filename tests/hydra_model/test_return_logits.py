"""``return_logits=False``: a forward with targets returns its losses alone (what the race's
training step asks for, so that a compiled forward does not give the unused logits a zero
gradient), with exactly the losses and gradients of the default forward."""

from __future__ import annotations

import copy

import pytest
import torch

from .conftest import random_tokens, small_model
from .test_gpt import random_model


def _model(kind: str, seed: int) -> torch.nn.Module:
    model = small_model(seed=seed) if kind == "hydra" else random_model("gqa", seed=seed)
    return model.train()


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = random_tokens(2, 13, vocab=vocab, seed=seed), random_tokens(2, 13, vocab=vocab, seed=seed + 1)
    y[0, :3] = -100  # ignored positions, as a prompt's
    return x, y


@pytest.mark.parametrize("kind", ["hydra", "gpt"])
def test_losses_and_gradients_equal_the_default_forward(kind):
    seed = int(torch.randint(0, 1000, ()))
    model = _model(kind, seed)
    twin = copy.deepcopy(model)
    x, y = _batch(model.config.vocab_size, seed)
    full = model(x, targets=y)
    lean = twin(x, targets=y, return_logits=False)
    assert full.logits is not None and lean.logits is None
    assert torch.equal(lean.loss, full.loss) and torch.equal(lean.ce_loss, full.ce_loss)
    assert lean.aux_losses.keys() == full.aux_losses.keys()
    for name, value in full.aux_losses.items():
        assert torch.equal(lean.aux_losses[name], value), name
    full.loss.backward()
    lean.loss.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert torch.equal(q.grad, p.grad), name


def test_compiled_forward_without_logits_gives_the_eager_gradients():
    model = random_model("gqa", seed=5).train()
    x, y = _batch(model.config.vocab_size, seed=7)
    eager = model(x, targets=y)
    eager.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x, targets=y, return_logits=False)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kind", ["hydra", "gpt"])
def test_without_targets_it_names_the_fix(kind):
    model = _model(kind, seed=0)
    with pytest.raises(ValueError, match="need targets; pass targets or keep return_logits=True"):
        model(random_tokens(1, 5, vocab=model.config.vocab_size), return_logits=False)
