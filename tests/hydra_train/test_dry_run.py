"""`hydra-train run --dry_run`: the fast path is the default on CUDA (checked here, without a GPU),
off on the CPU, each part can be turned off, and nothing is loaded or built."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import hydra_train.run as run_mod
from hydra_train.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _nothing_loaded(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a dry run must not load data or build a model")

    monkeypatch.setattr(run_mod, "load_run_data", refuse)
    monkeypatch.setattr(run_mod, "run_training", refuse)


def _dry(*args: str) -> dict:
    res = runner.invoke(app, ["run", "--dry_run", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cuda_defaults_are_the_fast_path():
    out = _dry("--device", "cuda")
    assert out["fast_path"] == {
        "triton_kernels": True,
        "chunked_ce": True,
        "cuda_graphs": True,
        "compiled_routing_glue": True,
        "compile": False,  # 300 steps of 16 × 1024: too short to repay a compile
        "precision": "bf16",
    }
    assert {"triton_kernels", "cuda_graphs"} <= set(out["would_pretest"])
    assert "compile" not in out["would_pretest"]
    assert out["config"]["model_size"] == "100M"  # the GPU preset


def test_cpu_defaults_stay_on_the_references():
    out = _dry("--device", "cpu")
    fast = out["fast_path"]
    assert not fast["triton_kernels"] and not fast["chunked_ce"] and fast["precision"] == "fp32"
    assert fast["compile"] is False
    assert "triton_kernels" not in out["would_pretest"] and "compile" not in out["would_pretest"]


@pytest.mark.parametrize(
    ("args", "scope"),
    [
        # 6103 × 8 × 2048 = 99.99M planned tokens: one step short of compiling
        (("--max_steps", "6103", "--batch_size", "8", "--seq_len", "2048"), False),
        (("--max_steps", "6104", "--batch_size", "8", "--seq_len", "2048"), "blocks"),
        (("--max_steps", "3052", "--batch_size", "8", "--seq_len", "2048", "--grad_accum", "2"), "blocks"),
        # 12207 × 8 × 2048 = 199.99M: one step short of the whole forward
        (("--max_steps", "12207", "--batch_size", "8", "--seq_len", "2048"), "blocks"),
        (("--max_steps", "12208", "--batch_size", "8", "--seq_len", "2048"), "model"),
        (("--mode", "production"), "model"),  # 100k steps
        (("--mode", "production", "--compile_scope", "blocks"), "blocks"),  # said: kept
        (("--compile", "--compile_scope", "model"), "model"),  # said: a short run compiles too
        (("--compile",), "blocks"),
    ],
)
def test_compile_follows_the_planned_tokens(args, scope):
    from hydra_train.config_options import (
        COMPILE_TOKENS,
        WHOLE_MODEL_COMPILE_TOKENS,
        WHOLE_MODEL_COMPILE_TOKENS_DDP,
    )

    assert (COMPILE_TOKENS, WHOLE_MODEL_COMPILE_TOKENS) == (100_000_000, 200_000_000)  # rows above
    assert WHOLE_MODEL_COMPILE_TOKENS_DDP == 400_000_000  # test_compile_defaults_where_they_were_measured
    assert _dry("--device", "cuda", *args)["fast_path"]["compile"] == scope


def test_compile_defaults_where_they_were_measured(monkeypatch):
    long_run = ("--mode", "production")
    assert _dry("--device", "cuda", *long_run)["fast_path"]["compile"] == "model"
    assert _dry("--device", "cpu", *long_run)["fast_path"]["compile"] is False
    assert _dry("--device", "cuda", "--fsdp", *long_run)["fast_path"]["compile"] == "blocks"
    assert _dry("--device", "cuda", "--no-compile", *long_run)["fast_path"]["compile"] is False
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # under torchrun (DDP): the whole forward from 400M tokens a process, the blocks below
    assert _dry("--device", "cuda", *long_run)["fast_path"]["compile"] == "model"  # 1,638M
    assert _dry("--device", "cuda", "--fsdp", *long_run)["fast_path"]["compile"] == "blocks"
    blocks = _dry("--device", "cuda", "--compile_scope", "blocks", *long_run)
    assert blocks["fast_path"]["compile"] == "blocks"
    assert _dry("--device", "cuda")["fast_path"]["compile"] is False  # short: none
    # 6103 × 8 × 2048 = 99.99M a process: one step short of compiling under torchrun
    per_process = ("--batch_size", "8", "--seq_len", "2048", "--max_steps")
    assert _dry("--device", "cuda", *per_process, "6103")["fast_path"]["compile"] is False
    assert _dry("--device", "cuda", *per_process, "6104")["fast_path"]["compile"] == "blocks"
    # 24414 × 8 × 2048 = 399.999M a process: one step short of the whole forward under torchrun
    assert _dry("--device", "cuda", *per_process, "24414")["fast_path"]["compile"] == "blocks"
    assert _dry("--device", "cuda", *per_process, "24415")["fast_path"]["compile"] == "model"


def test_the_scope_of_a_run_that_does_not_compile_does_not_follow_its_length():
    """The scope is part of the pretest log's fingerprint (safe_opts/pretest_log.py): two runs
    that compile nothing and differ only in length must not look like different setups."""
    short = _dry("--device", "cuda", "--no-compile")["config"]
    long = _dry("--device", "cuda", "--no-compile", "--mode", "production")["config"]
    assert short["compile_scope"] == long["compile_scope"] == "blocks"


def test_the_dry_run_says_why_it_compiles_or_not(monkeypatch):
    reason = _dry("--device", "cuda")["compile_reason"]
    assert reason.startswith("off: 4.9M planned tokens < 100M") and "--compile" in reason
    reason = _dry("--device", "cuda", "--mode", "production")["compile_reason"]
    assert reason == "on: 1,638.4M planned tokens >= 100M; scope model (>= 200M)"  # 100k × 16 × 1024
    assert _dry("--device", "cuda", "--no-compile")["compile_reason"] == "--no-compile given"
    assert _dry("--device", "cpu")["compile_reason"] == "off on the CPU"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    reason = _dry("--device", "cuda", "--mode", "production")["compile_reason"]
    assert "a process under torchrun >= 100M" in reason
    assert "scope model (>= 400M a process under torchrun)" in reason
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cuda"])  # the table for people
    assert res.exit_code == 0 and "compile because" in res.output


def test_compile_with_fsdp_compiles_the_blocks_and_refuses_the_whole_forward():
    asked = _dry("--device", "cuda", "--fsdp", "--compile", "--mode", "production")
    assert asked["fast_path"]["compile"] == "blocks"  # auto's scope under FSDP2, long run or not
    whole = ["--fsdp", "--compile", "--compile_scope", "model"]
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cuda", *whole])
    assert res.exit_code != 0 and "--fsdp compiles each block" in res.output


def test_each_part_of_the_fast_path_can_be_turned_off():
    out = _dry("--device", "cuda", "--no-triton_kernels", "--no-chunked-ce", "--no-experimental_cuda_graphs")
    fast = out["fast_path"]
    assert (fast["triton_kernels"], fast["chunked_ce"], fast["cuda_graphs"]) == (False, False, False)
    assert "triton_kernels" not in out["would_pretest"] and "cuda_graphs" not in out["would_pretest"]


def test_a_bad_flag_is_still_reported():
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cuda", "--model_size", "huge"])
    assert res.exit_code != 0 and "huge" in res.output


def test_dry_run_does_not_promise_cuda_graphs_under_fsdp(monkeypatch):
    # FSDP2 steps are never graphed (safe_opts' cuda_graphs is N/A there)
    assert _dry("--device", "cuda", "--fsdp")["fast_path"]["cuda_graphs"] is False
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _dry("--device", "cuda", "--ddp_grad_sync", "reducer")["fast_path"]["cuda_graphs"] is False
    assert _dry("--device", "cuda")["fast_path"]["cuda_graphs"] is True  # graphed DDP


def test_dry_run_gpt_has_no_routing_glue():
    assert _dry("--device", "cuda", "--arch", "gpt")["fast_path"]["compiled_routing_glue"] is False
    assert _dry("--device", "cuda")["fast_path"]["compiled_routing_glue"] is True


def test_dry_run_refuses_the_device_a_run_refuses():
    res = runner.invoke(app, ["run", "--dry_run", "--device", "tpu"])
    assert res.exit_code == 1 and "--device 'tpu'" in res.output, res.output


def test_dry_run_reports_an_unusable_variable(monkeypatch):
    monkeypatch.setenv("HYDRA_MEM_DUMP_EVERY", "ten")
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cpu"])
    assert res.exit_code == 1 and "HYDRA_MEM_DUMP_EVERY" in res.output, res.output
