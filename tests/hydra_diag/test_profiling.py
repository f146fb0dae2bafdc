"""profiling.py and perf_suite.py on the CPU (the CLIs need CUDA): the profiler plumbing, the trace
file, the kernel families, the attention rows."""

from __future__ import annotations

import json

import torch

from hydra_diag.perf_suite import _attention_rows
from hydra_diag.profiling import kernel_family, profile_kernels, python_overhead
from hydra_kernels.bench_harness import wall_timer

OV = {"dim": 64, "n_mor_blocks": 3, "vocab_size": 320}


def test_kernel_families():
    assert kernel_family("_rms_norm_fwd_kernel") == "hydra triton"
    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_family("flash_fwd_kernel") == "attention"
    assert kernel_family("triton_poi_fused_add_0") == "triton (other)"
    assert kernel_family("void at::native::vectorized_elementwise_kernel<4>") == "elementwise/reduce"
    assert kernel_family("something else") == "other"


def test_profile_kernels_writes_a_chrome_trace(tmp_path):
    trace = tmp_path / "trace.json"
    out = profile_kernels(
        "tiny", OV, batch_size=1, seq_len=16, warmup=1, steps=1, trace=str(trace), device="cpu"
    )
    assert json.loads(trace.read_text())["traceEvents"]
    assert out["trace"] == str(trace) and out["steps"] == 1
    assert out["wall_ms_per_step"] > 0


def test_python_overhead_rows():
    out = python_overhead("tiny", OV, batch_size=1, seq_len=16, warmup=1, steps=2, device="cpu")
    row = out["rows"][0]
    assert row["mode"] == "eager" and row["wall_ms"] > 0 and row["host_issue_ms"] > 0
    assert row["gpu_busy_ms"] is None  # no GPU timeline on a CPU


def test_attention_rows_report_each_backend():
    rows, info = _attention_rows("tiny", 1, 32, torch.device("cpu"), wall_timer(1))
    by = {r["impl"]: r for r in rows}
    assert by["flexible_attention[sdpa]"]["ms"] > 0 and by["flexible_attention[auto]"]["ms"] > 0
    # SDPA restricted to a CUDA-only kernel cannot run on the CPU: an error row, not a crash
    assert all("error" in r or r.get("ms") for r in rows)
    assert "autotune" in info
