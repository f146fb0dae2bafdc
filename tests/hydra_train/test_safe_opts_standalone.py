"""hydra-train pretest's library side: random batches, --all, a recorded standalone run."""

from __future__ import annotations

import torch

from hydra_train.config import TrainConfig
from hydra_train.safe_opts.pretest_log import PretestHook
from hydra_train.safe_opts.registry import build_registry
from hydra_train.safe_opts.standalone import RandomBatches, request_all, run_standalone

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
