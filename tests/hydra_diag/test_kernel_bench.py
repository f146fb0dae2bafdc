"""kernel_bench.py, hydra-diag's thin callers of hydra_kernels.bench_passes (whose measurements
tests/hydra_kernels/test_bench_passes.py tests): the user's errors as DiagError naming the command,
and the options handed through."""

from __future__ import annotations

import pytest
import torch

from hydra_diag.kernel_bench import bench_backward_kernels, bench_kernels_forward, bench_swiglu_backward
from hydra_diag.output import DiagError


def test_unknown_op_is_a_diag_error():
    with pytest.raises(DiagError, match="unknown op 'attention'; choose from rms_norm, fused_add_rms_norm"):
        bench_kernels_forward(ops=["attention"], device="cpu")


@pytest.mark.parametrize("name", ["linear_ce", "linear_cross_entropy"])
def test_linear_ce_is_taken_under_both_of_hydra_kernels_names(monkeypatch, name):
    from hydra_kernels import bench_passes

    seen = []
    monkeypatch.setattr(bench_passes, "bench_pass", lambda backward, ops, **kw: seen.append(ops) or {})
    bench_kernels_forward(ops=[name], device="cpu")
    assert seen == [["linear_ce"]]


@pytest.mark.parametrize(
    ("call", "command"),
    [
        (bench_kernels_forward, "bench kernels"),
        (bench_backward_kernels, "bench backward-kernels"),
        (bench_swiglu_backward, "bench swiglu-backward"),
    ],
)
def test_no_gpu_is_a_diag_error_naming_the_command(monkeypatch, call, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DiagError, match=f"^{command} needs a CUDA GPU"):
        call()


def test_options_reach_the_library():
    out = bench_backward_kernels(
        ops=["rope"], tokens=8, dims=(16,), head_shapes=((1, 4, 2, 8),), compile_peers=False, device="cpu"
    )
    assert out["tool"] == "benchmark_backward_kernels" and out["pass"] == "backward"
    assert {r["shape"] for r in out["rows"]} == {"1x4x2x8 R=4"}
    assert {r["impl"] for r in out["rows"] if r.get("ms")} == {"eager", "hydra", "hydra (torch bwd)"}
