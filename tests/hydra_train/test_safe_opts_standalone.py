"""hydra-train pretest's library side: random batches, --all, a recorded standalone run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_train.config import TrainConfig
from hydra_train.errors import HydraDataError
from hydra_train.safe_opts.pretest_log import PretestHook
from hydra_train.safe_opts.registry import build_registry
from hydra_train.safe_opts.standalone import RandomBatches, build_trainer, request_all, run_standalone
from hydra_train.shards import write_token_shard

from .conftest import TINY_OVERRIDES


def test_random_batches_are_a_pure_function_of_the_index():
    make = RandomBatches(3, 17, 100, seed=5)
    x, y = make(4)
    assert x.shape == y.shape == (3, 17) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(make(4)[0], x) and not torch.equal(make(5)[0], x)
    assert int(x.max()) < 100 and x.unique().numel() > 10  # random tokens, never a constant batch


def test_all_requests_every_optimization():
    reg = build_registry(request_all(TrainConfig(experimental_prefetch_threads=0)))
    assert all(o.requested() for o in reg.values())


def test_standalone_run_is_recorded(tmp_path):
    cfg = TrainConfig(
        model_size="tiny",
        device="cpu",
        batch_size=2,
        seq_len=16,
        vocab_size=200,
        cpu_threads=1,
        model_overrides=dict(TINY_OVERRIDES),
        static_routing_mode=True,
        pretest_warmup_steps=1,
        pretest_steps=2,
        checkpoint_dir=str(tmp_path),
    )
    lines: list[str] = []
    rec = run_standalone(cfg, only=["static_routing", "cuda_graphs"], log=lines.append)
    assert rec["results"]["static_routing"]["status"] == "PASS"
    assert rec["results"]["cuda_graphs"]["status"] == "N/A"
    assert (
        rec["config"]["dataset"] == "random"
        and rec["batch"] == [2, 16]
        and rec["trigger"] == "hydra-train pretest"
    )
    assert any(m.startswith("[SafeOpts] pretest arm static_routing") for m in lines)
    assert PretestHook(tmp_path / "pretest_logs").get_history()[-1]["fingerprint"] == rec["fingerprint"]


def _pretest_cfg(tmp_path, **fields) -> TrainConfig:
    overrides = {**TINY_OVERRIDES, "vocab_size": 64}  # the model's embedding: 64 rows
    return TrainConfig(
        model_size="tiny",
        device="cpu",
        batch_size=2,
        seq_len=16,
        cpu_threads=1,
        model_overrides=overrides,
        checkpoint_dir=str(tmp_path),
        **fields,
    )


def test_pretest_batches_fit_a_model_vocab_smaller_than_the_datas(tmp_path):
    """``--model_override vocab_size`` below the data's vocabulary: random batches drew ids up to
    the data's (past the model's embedding: a device-side assert on CUDA); real data with a
    recorded larger id is refused naming the shard before anything runs."""
    trainer, make_batch, _ = build_trainer(_pretest_cfg(tmp_path, vocab_size=200), log=lambda m: None)
    assert trainer.model.config.vocab_size == 64
    assert max(int(make_batch(i)[0].max()) for i in range(8)) < 64
    root = tmp_path / "data"
    write_token_shard(root / "train" / "a.bin", np.arange(3000) % 200)
    write_token_shard(root / "val" / "a.bin", np.arange(1000) % 200)
    with pytest.raises(HydraDataError, match=r"a\.bin: token id 199 .*model's vocabulary \[0, 64\)"):
        build_trainer(_pretest_cfg(tmp_path, vocab_size=200, dataset=str(root)), log=lambda m: None)
