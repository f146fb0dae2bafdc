"""The `hydra-kernels` command line: status, check (CPU, interpreter, --quick), bench (no CUDA)."""

import io
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from hydra_kernels import controls
from hydra_kernels.cli import app, render_bench_report
from hydra_kernels.ops import swiglu as sw

runner = CliRunner()
INTERPRETED = controls.device_supports_triton(torch.device("cpu"))


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("status", "check", "bench"):
        assert command in result.output


def test_status_json_has_switches_ops_and_resolved_launch_configs(no_cuda):
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    st = json.loads(result.stdout)
    assert st["device"] == "cpu" and st["triton_available"] is True
    assert set(st["ops"]) == {*controls.OPS, *controls.DECODE_OPS}
    expected = "triton" if INTERPRETED else "reference"
    assert {o["backend"] for o in st["ops"].values()} == {expected}
    assert st["launch"]["swiglu"]["LAUNCH_DEFAULTS"]["block_q"] == 1024  # the "default" entry
    assert st["launch"]["rope"]["LAUNCH_DEFAULTS"]["block_rows"] == 16
    assert all(st["launch"][op] for op in controls.OPS), st["launch"]  # every op shows its tables


def test_status_table_shows_switched_off_op(no_cuda):
    controls.set_op_enabled("rope", False)
    result = runner.invoke(app, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rope_line = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["rope"])
    assert "no" in rope_line and "reference" in rope_line
    assert "launch configurations" in result.stdout


@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_check_quick_on_cpu_runs_every_op_through_triton(no_cuda):
    result = runner.invoke(app, ["check", "--quick", "--json"])
    report = json.loads(result.stdout)
    assert report["mode"].startswith("Triton kernels under the Triton interpreter")
    names = {r["op"] for r in report["results"]}
    assert {"rms_norm", "fused_add_rms_norm", "swiglu", "qk_norm", "rope", "linear_cross_entropy"} <= names
    assert {r["dtype"] for r in report["results"]} == {"fp32", "bf16"}
    assert all(r["backend"] == "triton" for r in report["results"])
    # the exit code is the verdict
    assert result.exit_code == (0 if report["passed"] else 1)
    assert report["passed"] == all(r["passed"] for r in report["results"])


@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_check_table_passes_for_swiglu_and_rope(no_cuda):
    result = runner.invoke(
        app, ["check", "--quick", "--op", "swiglu", "--op", "rope"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "under the Triton interpreter" in result.stdout
    assert [
        line.split()[-1] for line in result.stdout.splitlines() if line.split()[:1] in (["swiglu"], ["rope"])
    ] == ["pass"] * 4


@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_check_exits_1_when_a_kernel_is_wrong(no_cuda, monkeypatch):
    real = sw._launch_swiglu_bwd
    monkeypatch.setattr(sw, "_launch_swiglu_bwd", lambda g, u, d: tuple(t * 1.05 for t in real(g, u, d)))
    result = runner.invoke(app, ["check", "--quick", "--op", "swiglu", "--dtype", "fp32"])
    assert result.exit_code == 1
    assert "1 of 1 checks failed" in result.stderr


def test_check_without_a_triton_path_says_it_checks_references(no_cuda):
    controls.set_use_triton_kernels(False)
    result = runner.invoke(app, ["check", "--quick", "--op", "rope", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "references only" in result.stdout


def test_check_rejects_unknown_op():
    result = runner.invoke(app, ["check", "--op", "nope"])
    assert result.exit_code == 2 and "unknown --op nope; choose from rms_norm" in result.stderr


def test_bench_without_cuda_is_one_line_and_exit_1(no_cuda):
    result = runner.invoke(app, ["bench"], env={"COLUMNS": "200"})  # rich wraps at the width
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0]


def test_bench_rejects_unknown_op_as_usage_error(no_cuda):
    result = runner.invoke(app, ["bench", "--op", "attention"])
    assert result.exit_code == 2 and "unknown --op attention" in result.stderr
    result = runner.invoke(app, ["bench", "--sweep", "--op", "rms_norm"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--sweep covers swiglu and rope" in result.stderr


def test_render_report_prints_tables():
    summary = {"op": "swiglu", "shape": "16384x2048", "hydra": 0.18, "compile": 0.5, "liger": 0.31}
    summary.update(best_peer="liger", vs_best_peer=1.72, gbps=2600.0, pct_copy=86.7, target="met")
    sweep = {"op": "swiglu", "shape": "16384x2048", "default": {"block_q": 4096, "num_warps": 8}}
    sweep.update(default_ms=0.2, best={"block_q": 2048, "num_warps": 4, "ms": 0.18}, trials=[])
    report = {
        "device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "torch": "2.11", "triton": "3.6",
        "liger": "0.8.5", "dtype": "bfloat16", "copy_tbps": 3.0, "summary": [summary], "sweep": [sweep],
        "rows": [{"op": "rope", "shape": "s", "impl": "liger", "ms": None, "note": "not comparable"}],
    }  # fmt: skip
    buf = io.StringIO()
    render_bench_report(report, Console(file=buf, width=220))
    text = buf.getvalue()
    assert "16384x2048" in text and "1.72x (liger)" in text and "87%" in text
    assert "liger skipped: not comparable" in text
    assert "block_q=2048, num_warps=4" in text and "10.0%" in text
