"""CUDAGraphStep: refuses what it cannot capture; on CUDA, replays equal eager steps."""

from __future__ import annotations

import pytest
import torch

from hydra_model import CUDAGraphStep

from .conftest import random_tokens, small_model


def test_refuses_cpu_inputs_and_zero_warmup():
    with pytest.raises(ValueError, match="CUDA tensor"):
        CUDAGraphStep(lambda x: x, torch.zeros(2))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="warmup"):
            CUDAGraphStep(lambda x: x, torch.zeros(2, device="cuda"), warmup=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replayed_training_steps_equal_eager_steps():
    """Two identical models and optimizers, one stepped eagerly, one through a captured graph
    (its warm-up steps mirrored eagerly): same losses and weights after every step."""
    data = [random_tokens(2, 17, seed=s).cuda() for s in range(6)]
    models = [small_model(seed=3).cuda().train() for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True) for m in models]

    def make(m, opt):
        def step(x):
            out = m(x[:, :-1], targets=x[:, 1:])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.loss.detach()

        return step

    eager, captured = make(models[0], opts[0]), make(models[1], opts[1])
    runner = CUDAGraphStep(captured, data[0], warmup=2)
    for _ in range(2):
        eager(data[0])
    for x in data[1:]:
        torch.testing.assert_close(runner(x), eager(x), atol=1e-4, rtol=1e-4)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
