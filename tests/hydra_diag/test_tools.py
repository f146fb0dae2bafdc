"""tools.py, `hydra_diag.list_tools()` / `run_tool()` and `python -m hydra_diag TOOL`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hydra_diag
from hydra_diag.cli import app
from hydra_diag.output import DiagError
from hydra_diag.tools import TOOLS, get_tool, tool_argv

from .conftest import TINY, VOCAB

SEED_LIST = {
    "benchmark_hydra_models",
    "benchmark_performance",
    "tall_skinny_bench",
    "throughput_sweep",
    "seq_len_vram_sweep",
    "benchmark_backward_kernels",
    "benchmark_swiglu_backward",
    "profile_kernels",
    "profile_python_overhead",
    "deep_diagnosis",
    "model_health_check",
    "eval_checkpoint",
    "eval_sanity_diagnostic",
    "loss_component_diagnostic",
    "diagnose_learning",
    "routing_healthcheck",
    "scaling_analysis",
    "sweep_training_knobs",
    "moe_specialization",
    "moe_watchdog",
    "moe_weight_balance",
    "convert_nemotron_jsonl_to_pt",
    "convert_small_chat_to_pt",
    "collect_pt_by_seq",
}


def _click_command(path: tuple[str, ...]):
    import typer.main

    cmd = typer.main.get_command(app)
    for part in path:
        cmd = cmd.commands[part]
    return cmd


def test_every_seed_tool_is_listed_with_a_real_command():
    tools = hydra_diag.list_tools()
    names = {t["name"] for t in tools}
    assert names >= SEED_LIST
    for t in tools:
        assert set(t) == {"name", "command", "needs_cuda", "description"}
        path = tuple(t["command"].split()[1:])
        cmd = _click_command(path)  # raises KeyError when the command does not exist
        if t["needs_cuda"]:
            assert "Needs CUDA" in cmd.help, t["name"]
        assert callable(get_tool(t["name"]).call)


def test_function_paths_resolve():
    import importlib

    for t in TOOLS:
        module, func = t.function.split(":")
        assert callable(getattr(importlib.import_module(f"hydra_diag.{module}"), func)), t.name


def test_run_tool_returns_the_result_dict():
    out = hydra_diag.run_tool("model_health_check", overrides={**TINY, "vocab_size": VOCAB}, seq_len=16)
    assert out["tool"] == "model_health_check" and out["passed"] is True
    assert json.dumps(out, default=str)


def test_run_tool_gpu_only_without_cuda_is_one_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DiagError, match="needs a CUDA GPU"):
        hydra_diag.run_tool("benchmark_hydra_models")
    with pytest.raises(DiagError, match="unknown tool"):
        hydra_diag.run_tool("no_such_tool")


def test_tool_argv_and_python_m(tmp_path):
    assert tool_argv("model_health_check.py", ["--json"]) == ["health", "model", "--json"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_diag",
            "model_health_check",
            "--json",
            "--seq_len",
            "16",
            "--set",
            "dim=64",
            "--set",
            f"vocab_size={VOCAB}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "HYDRA_DISABLE_TRITON": "1",
            "OMP_NUM_THREADS": "1",
        },  # references: the interpreter is slow
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passed"] is True
