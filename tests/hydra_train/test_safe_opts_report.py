"""OPTIMIZATIONS.md from records: every cell from the latest record, nothing typed by hand."""

from __future__ import annotations

import pytest

from hydra_train.safe_opts.report import build_report


def record(size, t, results, default_ms=(100.0, 102.0, 98.0, 100.0)):
    return {
        "model_size": size,
        "time": t,
        "batch": [8, 512],
        "grad_accum": 1,
        "precision": "bf16",
        "settings": {"warmup_steps": 2, "steps": 4},
        "config": {"params": 105e6, "dataset": "random"},
        "env": {"device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.11", "triton": "3.6"},
        "default": {"step_ms": list(default_ms)},
        "results": results,
    }


PASS = {
    "status": "PASS",
    "reason": None,
    "timing": {"median_ms": 50.0, "default_median_ms": 100.0, "speedup": 2.0},
}


def test_report_cells_reasons_latest_and_speedups():
    old = record("100M", "2026-01-01T00:00:00", {"compile": {"status": "FAIL", "reason": "old failure"}})
    new = record(
        "100M",
        "2026-01-02T00:00:00",
        {
            "compile": PASS,
            "fp8": {
                "status": "FAIL",
                "reason": "slower: 120 ms",
                "timing": {"median_ms": 120.0, "default_median_ms": 100.0},
            },
            "blackwell_tuning": {"status": "N/A", "reason": "for sm_100/sm_120 GPUs; this one is sm_90"},
            "cuda_graphs[static]": PASS,
        },
    )
    big = record("1B", "2026-01-03T00:00:00", {"compile": {"status": "FAIL", "reason": "slower: 120 ms"}})
    md = build_report([old, new, big], speedup_size="100M")
    # notes are numbered in table order; one note per distinct reason
    assert "| blackwell_tuning | `--experimental_blackwell_tuning` | N/A [1] |" in md
    assert "| fp8 | `--experimental_fp8` | FAIL [2] | not run | not run | not run |" in md
    assert "| compile | `--compile` | PASS | not run | not run | FAIL [2] |" in md
    assert "cuda_graphs (static routing)" in md and "old failure" not in md
    assert "1. for sm_100/sm_120 GPUs" in md and "2. slower: 120 ms" in md
    assert "| compile | PASS | default | 100.00 | 50.00 | 2.000 | 81,920 |" in md  # 8 × 512 tokens / 50 ms
    assert "NVIDIA H100 80GB HBM3 (Hopper, sm_90)" in md and "±1.0%" in md


def test_no_records():
    with pytest.raises(ValueError, match="no pretest records"):
        build_report([])
