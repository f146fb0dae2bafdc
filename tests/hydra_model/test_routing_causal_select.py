"""select_tokens (routing_causal.py): a forward without gradients takes a routing point's decision
from hydra_kernels' causal_select (one kernel on a GPU), training from the op-by-op rule
(CausalRouter.decide, take_first_k); both must give the same integers: the decision, the view's
rows, positions and membership, and the cache's counter (written in place where one is held).
Fresh random logits, candidates and positions; with hydra_kernels' Triton path on under the
interpreter (the kernel itself) and off (its PyTorch reference)."""

import os

import pytest
import torch

import hydra_kernels
from hydra_model.blocks import RunContext
from hydra_model.cache import ModelCache
from hydra_model.causal_routing import CausalRouter
from hydra_model.routing_causal import select_tokens


def case(seed: int, b: int, n: int, with_cand: bool, with_pos: bool):
    g = torch.Generator().manual_seed(seed)
    router = CausalRouter(capacity=float(torch.empty(()).uniform_(0.1, 0.9, generator=g)), target=0.5,
                          momentum=0.9, key=(1, -1))  # fmt: skip
    router.threshold.tau.fill_(float(torch.randn((), generator=g)) * 0.3)
    logit = torch.randn(b, n, generator=g)
    cand = torch.rand(b, n, generator=g) < 0.7 if with_cand else None
    pos = torch.cumsum(torch.randint(1, 3, (b, n), generator=g), 1) - 1 if with_pos else None
    return router, logit, cand, pos


@pytest.mark.parametrize("triton_path", [False, True])
@pytest.mark.parametrize(("with_cand", "with_pos"), [(False, False), (True, True)])
def test_the_no_grad_selection_equals_the_training_rule(triton_path, with_cand, with_pos):
    if triton_path and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on the CPU only under TRITON_INTERPRET=1")
    hydra_kernels.set_use_triton_kernels(triton_path)
    seed = int.from_bytes(os.urandom(4), "little")
    router, logit, cand, pos = case(seed, 3, 37, with_cand, with_pos)
    caches = [ModelCache(capacity=64), ModelCache(capacity=64)]
    held = torch.full((3,), 99, dtype=torch.long)
    caches[1].counts[router.key] = held  # a restarted cache's counter: written in place
    for cache in caches:
        ctx = RunContext(None, cache, seq_len=60)
        with torch.no_grad():
            taken, view = select_tokens(router, logit, pos, cand, ctx)
        ref_ctx = RunContext(None, ModelCache(capacity=64), seq_len=60)
        want_taken, want = select_tokens(router, logit.clone().requires_grad_(), pos, cand, ref_ctx)
        msg = f"seed {seed}"
        assert torch.equal(taken, want_taken), msg
        for name in ("idx", "pos", "member", "flat"):
            assert torch.equal(getattr(view, name), getattr(want, name)), f"{msg}: {name}"
        assert torch.equal(cache.counts[router.key], ref_ctx.cache.counts[router.key]), msg
    assert caches[1].counts[router.key] is held
