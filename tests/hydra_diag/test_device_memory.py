"""hydra_diag.device_memory on the CPU, against a stand-in for torch.cuda's caching allocator
(fake_cuda.py), and two of the callers that report it: the benchmark harness and
bench/race_profile.py (the race's entry: test_race_parts.py).

Before it, each caller reset the peaks after its warm-up and reported ``max_memory_allocated``:
once CUDA graphs are captured a replay writes its activations and gradients into the graphs'
private pool without allocating, so under the race's graphs scope that figure was parameters plus
AdamW's moments (1.19 GiB for the 100M HYDRA, whose step needs about 8.5). ``peak_gib`` must
include that pool."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hydra_diag.device_memory import MEMORY_FIELDS, peak_memory, reset_peak_memory
from hydra_diag.harness import StepHarness

from . import fake_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "packages" / "hydra-diag" / "bench" / "race_profile.py"
CUDA = torch.device("cuda")
#: the race-style warm-up then graphed steps (fake_cuda.FakeAllocator): parameters and optimizer
#: state, the graph's pool, one step's eager temporaries; the allocated peak leaves the pool out
GRAPHED = {
    "peak_gib": (1140 + 7000 + 50) / 1024,
    "graph_pool_gib": 7000 / 1024,
    "peak_allocated_gib": (1140 + 50) / 1024,
}


def test_peak_memory_of_a_graphed_step_counts_the_graph_pool(monkeypatch):
    cuda = fake_cuda.install(monkeypatch)
    cuda.warm_up_race_style()
    reset_peak_memory(CUDA)
    for _ in range(3):
        cuda.graphed_step()
    # not the eager warm-up's cached activations either: the cache is emptied before the reset
    assert peak_memory(CUDA) == pytest.approx(GRAPHED)
    assert cuda.calls == ["empty_cache", "reset_peak_memory_stats"]


def test_a_reset_that_keeps_the_cache_counts_what_the_warm_up_left_cached(monkeypatch):
    cuda = fake_cuda.install(monkeypatch)
    cuda.warm_up_race_style()
    reset_peak_memory(CUDA, release_cache=False)
    for _ in range(3):
        cuda.graphed_step()
    assert cuda.calls == ["reset_peak_memory_stats"]
    assert peak_memory(CUDA)["peak_gib"] > GRAPHED["peak_gib"]


def test_the_pool_of_the_device_asked_for(monkeypatch):
    fake_cuda.install(monkeypatch)
    assert peak_memory(torch.device("cuda", 1))["graph_pool_gib"] == pytest.approx(999 / 1024)


def test_a_torch_that_does_not_name_segment_pools_gives_no_pool_figure(monkeypatch):
    cuda = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"device": 0, "total_size": 10}])
    reset_peak_memory(CUDA)
    memory = peak_memory(CUDA)
    assert memory["graph_pool_gib"] is None and memory["peak_gib"] == 0
    assert cuda.calls == ["empty_cache", "reset_peak_memory_stats"]


def test_no_figures_off_cuda(monkeypatch):
    cuda = fake_cuda.install(monkeypatch)
    reset_peak_memory(torch.device("cpu"))
    assert peak_memory(torch.device("cpu")) == dict.fromkeys(MEMORY_FIELDS)
    assert cuda.calls == []


def test_harness_peak_counts_the_graph_pool(monkeypatch):
    """``bench model``, the sweeps: a harness whose forward replays CUDA graphs (torch.compile with
    TORCHINDUCTOR_CUDAGRAPHS=1, or a caller's graphed forward)."""
    cuda = fake_cuda.install(monkeypatch)
    cuda.warm_up_race_style()

    class Graphed(StepHarness):
        def step(self) -> torch.Tensor:
            return cuda.graphed_step()

    h = Graphed(None, None, None, [], batch_size=2, seq_len=8, device=CUDA)
    r = h.timed_steps(3)
    assert r["peak_gib"] == pytest.approx(GRAPHED["peak_gib"])
    assert {k: r[k] for k in MEMORY_FIELDS} == pytest.approx(GRAPHED)
    assert r["step_ms"] == 2.0 and r["tokens_per_s"] == pytest.approx(16 / 0.002)


def test_race_profile_reports_the_library_figures(monkeypatch):
    spec = importlib.util.spec_from_file_location("race_profile", SCRIPT)
    race_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(race_profile)
    cuda = fake_cuda.install(monkeypatch)
    cuda.warm_up_race_style()
    _dt, loss, memory = race_profile.steady_steps(cuda.graphed_step, 3, CUDA)
    assert float(loss) == 1.0
    assert memory == {k: round(v, 2) for k, v in GRAPHED.items()}
