"""hydra_kernels.bench, the parts that run without a GPU: workloads and byte floors, target
verdicts, rendering, and the clear refusal on a CPU-only machine (the forward+backward step it
times is tests/hydra_kernels/test_bench_harness.py's)."""

import pytest
import torch

from hydra_kernels import bench, benchmark_kernels, controls, print_benchmark_results, swiglu
from hydra_kernels.launch_config import resolve_launch_config
from hydra_kernels.ops import swiglu as sw
from hydra_kernels.ops.swiglu import swiglu_ref


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _workloads(op):
    return list(bench._workloads(op, torch.device("meta"), torch.bfloat16, {}, "no liger here"))


def test_cpu_only_machines_get_a_clear_error(no_cuda):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        benchmark_kernels(batch_size=1, seq_len=8, dim=64)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.run_bench(ops=["swiglu"])


def test_perf_md_rows_and_byte_floors():
    sw = {w.shape: w for w in _workloads("swiglu")}
    assert list(sw) == ["16384x2048", "16384x5440", "16384x10880", "16384x5440 packed"]
    assert sw["16384x2048"].bytes_floor == 7 * 16384 * 2048 * 2  # docs/TARGETS.md: 0.157 ms at 3.0 TB/s
    assert abs(sw["16384x2048"].bytes_floor / 3.0e12 * 1e3 - 0.157) < 0.001
    assert sw["16384x5440 packed"].inputs[0].shape == (16384, 2 * 5440)
    rms = {w.shape: w for w in _workloads("rms_norm")}
    assert rms["16384x768"].bytes_floor == 5 * 16384 * 768 * 2
    rope = [w.shape for w in _workloads("rope")]
    assert rope == ["8x2048x6x64 R=32", "8x2048x6x64 R=64", "8x2048x16x128 R=64", "8x2048x16x128 R=128"]
    for w in _workloads("rope"):
        assert set(w.impls) == {"eager", "compile", "hydra"} and "liger" in w.notes
    ce = _workloads("linear_cross_entropy")
    assert [w.shape for w in ce] == ["16384x768 V=50304", "16384x2048 V=128256"]
    assert [w.shape for w in _workloads("linear_ce")] == [w.shape for w in ce]  # the old spelling
    assert all(
        w.measure_memory
        and w.flops == 6.0 * 16384 * int(w.shape.split("x")[1].split()[0]) * w.inputs[1].shape[0]
        for w in ce
    )
    with pytest.raises(ValueError, match="unknown bench op"):
        _workloads("attention")


def test_sweep_configs_are_launchable():
    for op, configs in bench.SWEEP_CONFIGS.items():
        assert configs, op
        for cfg in configs:
            for key in ("block_q", "block_rows", "num_warps"):
                if key in cfg:
                    assert cfg[key] & (cfg[key] - 1) == 0, (op, cfg)  # powers of two


def _workload(op="swiglu", bytes_floor=200 * 2**20):
    return bench.Workload(
        op, "s", [], None, {}, bytes_floor=bytes_floor, measure_memory=op == "linear_cross_entropy"
    )


def _rows(**ms):
    return [{"impl": k, "ms": v, **extra} for k, (v, extra) in ms.items()]


def test_summary_verdicts():
    fast = _rows(hydra=(0.1, {"pct_copy": 85.0, "gbps": 2550.0}), compile=(0.2, {}), liger=(0.15, {}))
    s = bench.summarize(_workload(), fast)
    assert s["target"] == "met" and s["best_peer"] == "liger" and s["vs_best_peer"] == pytest.approx(1.5)
    slow = _rows(hydra=(0.3, {"pct_copy": 50.0}), compile=(0.2, {}), eager=(0.1, {}))
    s = bench.summarize(_workload(), slow)
    assert (
        s["target"].startswith("MISS") and "1.50x the time of compile" in s["target"] and "50%" in s["target"]
    )
    small = _rows(hydra=(0.1, {"pct_copy": 10.0}), compile=(0.2, {}))
    assert bench.summarize(_workload(bytes_floor=2**20), small)["target"] == "met"  # < 64 MB: no bw target
    ce = _rows(
        hydra=(5.0, {"peak_extra_mib": 200.0}), compile=(7.0, {}), liger=(9.0, {"peak_extra_mib": 100.0})
    )
    s = bench.summarize(_workload("linear_cross_entropy", 0), [*ce, *_rows(**{"hydra slab": (6.0, {})})])
    assert "MiB > Liger" in s["target"] and "time of" not in s["target"]  # time: against compile only
    assert s["modes"]["hydra slab"]["time_ok"] is True  # the other dW schemes, each against both targets
    broken = [{"impl": "hydra", "ms": None, "error": "boom"}, {"impl": "compile", "ms": 1.0}]
    assert "hydra not timed: boom" in bench.summarize(_workload(), broken)["target"]


def test_print_benchmark_results_format(capsys):
    print_benchmark_results(
        {
            "rope": {"pytorch_ms": 0.342, "triton_ms": 0.163, "speedup": 2.098, "backend": "triton"},
            "swiglu": {"pytorch_ms": 0.5, "triton_ms": 0.5, "speedup": 1.0, "backend": "reference"},
        }
    )
    out = capsys.readouterr().out
    assert "RoPE:\n  PyTorch: 0.342 ms\n  Triton:  0.163 ms\n  Speedup: 2.10x" in out
    assert "SwiGLU:" in out and "the reference ran" in out


def _tiny_swiglu_workload():
    a, b = torch.randn(3, 40, requires_grad=True), torch.randn(3, 40, requires_grad=True)
    impls = {"eager": swiglu_ref, "hydra": swiglu}
    return bench.Workload(
        "swiglu", "3x40", [a, b], torch.randn(3, 40), impls, {"liger": "absent"}, 7 * 120 * 4
    )


@pytest.fixture
def fake_gpu(monkeypatch):
    """Enough of a GPU for run_bench's bookkeeping; every 'timing' runs the step once and
    reports 1 ms (the hydra op 0.5 ms), so the pipeline is exercised end to end on the CPU."""
    calls = []

    def fake_time(step, rep=100):
        calls.append(step)
        step()  # the real kernels run (interpreted), with whatever launch overrides are set
        return 0.5 if getattr(step, "impl", None) == "hydra" else 1.0

    real_step = bench.fwd_bwd_step

    def tagged_step(fn, inputs, grad_out):
        step = real_step(fn, inputs, grad_out)
        step.impl = "hydra" if fn is swiglu else "peer"
        return step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "copy_bandwidth_tbps", lambda dev: 3.0)
    monkeypatch.setattr(bench, "time_ms", fake_time)
    monkeypatch.setattr(bench, "fwd_bwd_step", tagged_step)
    monkeypatch.setattr(bench, "_workloads", lambda op, *a: iter([_tiny_swiglu_workload()]))
    monkeypatch.setattr(controls, "device_supports_triton", lambda dev: controls.INTERPRETER_ACTIVE)
    return calls


@pytest.mark.skipif(not controls.INTERPRETER_ACTIVE, reason="needs the Triton interpreter on the CPU")
def test_run_bench_pipeline_on_a_fake_gpu(fake_gpu):
    report = bench.run_bench(ops=["swiglu"])
    assert report["device"] == "fake GPU" and report["copy_tbps"] == 3.0
    (s,) = report["summary"]
    assert s["hydra"] == 0.5 and s["eager"] == 1.0 and "vs_best_peer" not in s  # eager is no target
    assert s["target"] == "met" and s["pct_copy"] == pytest.approx(100 * 7 * 120 * 4 / 0.5e-3 / 3e12)
    assert {r["impl"] for r in report["rows"]} == {"eager", "hydra", "liger"}
    assert controls.fallback_counts()["swiglu"] == 0


@pytest.mark.skipif(not controls.INTERPRETER_ACTIVE, reason="needs the Triton interpreter on the CPU")
def test_sweep_tries_every_config_and_restores_the_defaults(fake_gpu):
    report = bench.run_bench(ops=["swiglu", "rms_norm"], sweep=True)
    assert report["summary"] == [] and len(report["sweep"]) == 1  # rms_norm has no sweep
    (s,) = report["sweep"]
    assert len(s["trials"]) == len(bench.SWEEP_CONFIGS["swiglu"]) and all(t["ms"] for t in s["trials"])
    assert s["default"] == {"block_q": 1024, "num_warps": 4} and s["best"]["ms"] == 0.5
    assert resolve_launch_config("swiglu", torch.device("cpu"), sw.LAUNCH_DEFAULTS).block_q == 1024
    assert controls.fallback_counts()["swiglu"] == 0
