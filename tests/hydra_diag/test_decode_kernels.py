"""bench/decode_kernels.py: the kernel counter counts what a GPU would launch (an aten kernel once,
a Triton launch once with the interpreter's own work inside it not counted, views never), and a
decode step's count grows by the same amount per layer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import hydra_kernels
from hydra_kernels.controls import INTERPRETER_ACTIVE

# the counter counts Triton launches by way of the interpreter (on a CUDA machine the suite runs the
# kernels for real and CPU tensors take the references)
pytestmark = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="counts Triton launches under TRITON_INTERPRET"
)

SCRIPT = Path(__file__).resolve().parents[2] / "packages" / "hydra-diag" / "bench" / "decode_kernels.py"


def _script():
    spec = importlib.util.spec_from_file_location("decode_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counter_counts_kernels_not_views_and_a_triton_launch_once():
    dk = _script()
    x, w = torch.randn(6, 32), torch.rand(32) + 0.5
    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(True)
    try:
        with dk.KernelCount() as counter:
            y = (x + 1).view(3, 64).transpose(0, 1)  # one kernel, two views
            z = hydra_kernels.rms_norm(x, w, 1e-6)  # one Triton launch
    finally:
        hydra_kernels.set_use_triton_kernels(was)
    triton_launches = {k: n for k, n in counter.kernels.items() if k.startswith("triton:")}
    assert counter.kernels["add"] == 1 and y.shape == (64, 3)
    assert list(triton_launches.values()) == [1], counter.kernels
    assert sum(counter.kernels.values()) == 2, counter.kernels
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(z, ref, rtol=1e-5, atol=1e-5)


def test_a_decode_step_adds_the_same_kernels_per_layer():
    dk = _script()
    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(True)
    try:
        counts = {n: dk.count_decode_step("gpt", "tiny", {"n_layers": n}) for n in (1, 2, 3)}
        hydra = dk.count_decode_step("hydra", "tiny", {"n_mor_blocks": 4, "mod_block_stride": 2})
    finally:
        hydra_kernels.set_use_triton_kernels(was)
    assert all(c["routed_blocks"] == [] for c in counts.values())
    one, two, three = (counts[n]["plain"] for n in (1, 2, 3))
    assert two - one == three - two > 0
    assert hydra["plain"] > 0 and hydra["routed_blocks"] and hydra["prefill"] > hydra["plain"]
    assert len(set(hydra["routed_blocks"])) == 1  # every routed block launches the same kernels
    assert hydra["all_blocks_run"] == hydra["plain"] + sum(hydra["routed_blocks"])
