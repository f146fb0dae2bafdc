"""model_bench.py and harness.py on the CPU (the CLI needs CUDA): tokens/s arithmetic, FLOP counts,
sweep bookkeeping."""

from __future__ import annotations

import pytest
import torch

from hydra_diag.harness import StepHarness, compile_model, peak_flops
from hydra_diag.loading import build_model
from hydra_diag.model_bench import bench_model, throughput_sweep, vram_sweep
from hydra_diag.output import DiagError

from .conftest import TINY, VOCAB

OV = {"dim": 64, "n_mor_blocks": 3, "vocab_size": VOCAB}


def test_bench_model_rows():
    out = bench_model(
        "tiny",
        configs=("dynamic", "dense"),
        batch_size=2,
        seq_len=32,
        steps=2,
        warmup=1,
        overrides=OV,
        device="cpu",
    )
    rows = {r["config"]: r for r in out["rows"]}
    for r in rows.values():
        assert r.get("error") is None
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["step_ms"] / 1000))
        assert r["mfu"] is None  # no peak known for a CPU
    # routing executes less than the dense equivalent of the same model
    assert rows["dynamic"]["flops_per_token_executed"] < rows["dynamic"]["flops_per_token_dense"]


def test_throughput_and_vram_sweeps():
    out = throughput_sweep(
        "tiny", batch_sizes=(1, 2), seq_lens=(16, 32), steps=1, warmup=1, overrides=OV, device="cpu"
    )
    assert [(c["batch_size"], c["seq_len"]) for c in out["cells"]] == [(1, 16), (2, 16), (1, 32), (2, 32)]
    assert out["best"]["tokens_per_s"] == max(c["tokens_per_s"] for c in out["cells"])
    v = vram_sweep("tiny", batch_size=1, start_seq=16, max_seq=64, overrides=OV, device="cpu")
    assert [p["seq_len"] for p in v["points"]] == [16, 32, 64]
    assert v["capped"] is True and v["longest_fitting_seq_len"] == 64
    est = [p["estimated_gib"] for p in v["points"]]
    assert est[0] < est[1] < est[2]


def test_harness_steps_learn_and_time():
    torch.manual_seed(0)
    h = StepHarness.build(
        build_model("tiny", {**TINY, "vocab_size": VOCAB}), 2, 16, torch.device("cpu"), n_batches=1
    )
    first = float(h.step())
    r = h.timed_steps(5)
    assert r["final_loss"] < first  # the same batch every step: the loss falls
    assert r["step_ms"] >= r["step_ms_min"] > 0


def test_peak_and_compile_scope():
    assert peak_flops(torch.device("cpu"), 100.0) == (100e12, "--peak-tflops")
    with pytest.raises(DiagError):
        compile_model(build_model("tiny", {**TINY, "vocab_size": VOCAB}), "everything")
