"""A kernel op is its module, ONE registry entry and its test: everything else in hydra_kernels
that lists ops (switches, exports, checks, benchmarks, the CLI) reads the registry."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from typer.main import get_command

import hydra_kernels
from hydra_kernels import bench, checks, cli, controls
from hydra_kernels.options import OPTIONS
from hydra_kernels.registry import OP_SPECS, OPS_BY_NAME

TESTS = Path(__file__).resolve().parent


def test_every_table_is_the_registry():
    names = tuple(s.name for s in OP_SPECS)
    # the decode-step ops have switches and fallback counts but no registry entry
    assert names == controls.OPS and tuple(OPTIONS.ops) == (*names, *controls.DECODE_OPS)
    assert {c.control_op for c in checks.CASES} == set(names)
    assert [c.name for c in checks.CASES] == [c.name for s in OP_SPECS for c in s.checks]
    assert set(bench.BENCH_OPS.values()) <= set(names)
    assert list(bench.BENCH_OPS) == [b for s in OP_SPECS for b in s.bench]
    assert {s.name: s.module for s in OP_SPECS} == cli._OP_MODULES
    exported = {n for s in OP_SPECS for n in s.exports}
    assert exported <= set(hydra_kernels.__all__)
    for spec in OP_SPECS:
        module = importlib.import_module(spec.module)
        for name in spec.exports:
            assert getattr(hydra_kernels, name) is getattr(module, name)
        for c in spec.checks:  # the names an entry gives resolve in its module
            assert callable(getattr(module, c.fn)) and callable(getattr(module, c.ref))
        if spec.sweep:
            assert isinstance(getattr(module, spec.sweep_table), dict)


@pytest.mark.parametrize("spec", OP_SPECS, ids=lambda s: s.name)
def test_every_op_has_its_test_module(spec):
    assert (TESTS / f"test_{spec.name}.py").is_file()


def test_the_environment_switch_of_an_entry_reaches_its_op(monkeypatch):
    for spec in OP_SPECS:
        monkeypatch.setenv(f"HYDRA_DISABLE_{spec.env}", "1")
    for stem in controls.DECODE_OPS.values():
        monkeypatch.setenv(f"HYDRA_DISABLE_{stem}", "1")
    controls.reload_env()
    assert not any(sw.forward or sw.backward for sw in OPTIONS.ops.values())


def test_the_cli_lists_the_registered_bench_ops():
    bench_cmd = get_command(cli.app).commands["bench"]
    op_help = next(p.help for p in bench_cmd.params if p.name == "op")
    for name in bench.BENCH_OPS:
        assert name in op_help


@pytest.mark.parametrize("name", list(bench.BENCH_OPS))
def test_every_bench_op_has_workloads(name):
    spec = OPS_BY_NAME[bench.BENCH_OPS[name]]
    workloads = list(spec.bench[name](torch.device("meta"), torch.bfloat16, {}, "no liger here"))
    assert workloads and all("hydra" in w.impls for w in workloads)
