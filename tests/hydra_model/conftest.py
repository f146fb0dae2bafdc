"""Shared fixtures: model tests run the hydra_kernels PyTorch references (fast on CPU); one test
in test_model.py switches the Triton kernels on under the interpreter and compares."""

from __future__ import annotations

import pytest
import torch

import hydra_kernels
from hydra_model import CCGQAMoDMoRModel, HydraConfig


@pytest.fixture(autouse=True)
def _reference_kernels_one_thread():
    # one intra-op thread: on a shared 2-core machine more threads only contend (60× slower)
    was, threads = hydra_kernels.use_triton_kernels(), torch.get_num_threads()
    hydra_kernels.set_use_triton_kernels(False)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        hydra_kernels.set_use_triton_kernels(was)
        torch.set_num_threads(threads)


#: Small but not degenerate: widths that are not powers of two, GQA groups of 2, a routed middle
#: block between the dense first and last, three recursions.
SMALL = dict(
    vocab_size=97,
    dim=48,
    n_mor_blocks=3,
    recursions_per_block=3,
    n_heads=4,
    n_kv_heads=2,
    compression_factor=1.5,
    mlp_ratio=2.0,
    mlp_multiple_of=8,
    max_seq_len=64,
    init_std=0.2,
)

#: The routing modes every mode-wise test covers.
MODES: dict[str, dict] = {
    "dynamic": {},
    "expert_choice": {"routing": "expert_choice"},
    "static": {"static_routing_mode": True},
    "moe": {"moe_enabled": True, "moe_num_experts": 3, "moe_top_k": 2},
    "moe_loss_free": {
        "moe_enabled": True,
        "moe_num_experts": 4,
        "moe_top_k": 1,
        "moe_balancing": "loss_free",
    },
    "token_choice": {"mor_routing": "token_choice", "ponder_weight": 0.1},
    "routing_off": {"routing_off": True},
}


def small_config(**overrides) -> HydraConfig:
    return HydraConfig(**{**SMALL, **overrides})


def small_model(seed: int = 0, **overrides) -> CCGQAMoDMoRModel:
    """A SMALL model whose blocks outweigh the embedding on the residual stream, so greedy
    continuations vary (with the tied head, a model dominated by its input embedding mostly
    repeats the last token) and routers see varied inputs."""
    torch.manual_seed(seed)
    model = CCGQAMoDMoRModel(small_config(**overrides))
    with torch.no_grad():
        model.embed.weight.mul_(0.1)
    return model


def random_tokens(batch: int, seq: int, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
