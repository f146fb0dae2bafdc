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
        "precision": "bf16",
    }
    assert {"triton_kernels", "cuda_graphs"} <= set(out["would_pretest"])
    assert out["config"]["model_size"] == "100M"  # the GPU preset


def test_cpu_defaults_stay_on_the_references():
    out = _dry("--device", "cpu")
    fast = out["fast_path"]
    assert not fast["triton_kernels"] and not fast["chunked_ce"] and fast["precision"] == "fp32"
    assert "triton_kernels" not in out["would_pretest"]


def test_each_part_of_the_fast_path_can_be_turned_off():
    out = _dry("--device", "cuda", "--no-triton_kernels", "--no-chunked-ce", "--no-experimental_cuda_graphs")
    fast = out["fast_path"]
    assert (fast["triton_kernels"], fast["chunked_ce"], fast["cuda_graphs"]) == (False, False, False)
    assert "triton_kernels" not in out["would_pretest"] and "cuda_graphs" not in out["would_pretest"]


def test_a_bad_flag_is_still_reported():
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cuda", "--model_size", "huge"])
    assert res.exit_code != 0 and "huge" in res.output
