"""bench/train_counts.py: the training forward traces as one graph with no breaks, the counts grow
with the layers as they should, and the thresholds' commit launches as many kernels for many
routing points as for one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import hydra_kernels
from hydra_kernels.controls import INTERPRETER_ACTIVE

pytestmark = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="counts Triton launches under TRITON_INTERPRET"
)

SCRIPT = Path(__file__).resolve().parents[2] / "packages" / "hydra-diag" / "bench" / "train_counts.py"


@pytest.fixture
def counts():
    spec = importlib.util.spec_from_file_location("train_counts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(True)
    try:
        yield module.count
    finally:
        hydra_kernels.set_use_triton_kernels(was)


def test_the_dense_gpt_adds_the_same_ops_and_kernels_per_layer(counts):
    rows = {n: counts("gpt", "tiny", {"n_layers": n}, 1, 8) for n in (1, 2, 3)}
    for key in ("traced_ops", "forward_kernels", "backward_kernels"):
        assert rows[3][key] - rows[2][key] == rows[2][key] - rows[1][key] > 0, (key, rows)
    assert all(r["graphs"] == 1 and r["graph_breaks"] == 0 for r in rows.values())


def test_hydras_training_forward_is_one_graph_and_its_commit_does_not_grow_with_routing_points(counts):
    few = counts("hydra", "tiny", {"n_mor_blocks": 4, "mod_block_stride": 2}, 1, 8)
    many = counts("hydra", "tiny", {"n_mor_blocks": 4, "mod_block_stride": 1}, 1, 8)
    assert few["graphs"] == 1 and few["graph_breaks"] == 0, few
    assert many["routing_points"] > few["routing_points"] > 0
    assert many["commit_kernels"] == few["commit_kernels"] > 0
    assert many["forward_kernels"] > few["forward_kernels"]  # routed blocks have glue of their own
