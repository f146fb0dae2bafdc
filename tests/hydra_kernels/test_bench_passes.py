"""hydra_kernels.bench_passes on the CPU (the hydra-diag commands need CUDA; the library runs
anywhere when given a device): the workloads, the byte and FLOP accounting, the switch restored,
private inputs per implementation."""

from __future__ import annotations

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.bench_harness import wall_timer
from hydra_kernels.bench_passes import Case, bench_pass, bench_swiglu_backward, time_backward

SMALL = dict(tokens=40, dims=(48,), head_shapes=((2, 8, 2, 16),), compile_peers=False, device="cpu")


def test_forward_rows_and_rates():
    out = bench_pass(False, **SMALL)
    ops = {r["op"] for r in out["rows"]}
    assert ops == {"rms_norm", "fused_add_rms_norm", "swiglu", "qk_norm", "rope", "linear_ce"}
    for r in out["rows"]:
        if r.get("ms"):
            if "gbps" in r:
                assert r["gbps"] > 0
            assert r.get("error") is None
    rms = next(r for r in out["rows"] if r["op"] == "rms_norm" and r["impl"] == "hydra")
    bytes_fwd = (2 * 40 * 48 + 48) * 2  # read x and w, write y, bf16
    assert rms["gbps"] == pytest.approx(bytes_fwd / (rms["ms"] * 1e-3) / 1e9)
    ce = next(r for r in out["rows"] if r["op"] == "linear_ce" and r["impl"] == "hydra")
    assert ce["tflops"] == pytest.approx(2.0 * 40 * 48 * 32000 / (ce["ms"] * 1e-3) / 1e12)
    assert any(r.get("note") for r in out["rows"] if r["impl"] == "liger") or any(
        r["impl"] == "liger" and r.get("ms") for r in out["rows"]
    )
    assert {s["op"] for s in out["summary"]} == ops


def test_backward_rows_restore_the_switch():
    before = hk.get_kernel_status()["ops"]["swiglu"]["backward_enabled"]
    out = bench_pass(True, ops=["swiglu", "rms_norm", "qk_norm"], **SMALL)
    impls = {(r["op"], r["impl"]) for r in out["rows"] if r.get("ms")}
    for op in ("swiglu", "rms_norm", "qk_norm"):
        assert {(op, "hydra"), (op, "hydra (torch bwd)"), (op, "eager")} <= impls
    assert hk.get_kernel_status()["ops"]["swiglu"]["backward_enabled"] == before


def test_swiglu_backward_grid():
    out = bench_swiglu_backward(tokens=(16, 24), widths=(10, 33), device="cpu")
    assert {(r["tokens"], r["width"]) for r in out["rows"]} == {(16, 10), (16, 33), (24, 10), (24, 33)}
    assert {r["impl"] for r in out["rows"]} == {"hydra", "hydra (torch bwd)", "eager", "hydra packed"}
    r = out["rows"][0]
    assert r["bytes"] == 5 * r["tokens"] * r["width"] * 2


def test_each_implementation_gets_its_own_inputs():
    """A peer that writes into its inputs (as Liger's SwiGLU backward does) must not change the data
    the next implementation is timed on."""
    seen = []

    def clobbering(gate, up):
        out = gate * up
        with torch.no_grad():
            gate.zero_()  # the next implementation would see zeros if inputs were shared
        return out

    def recording(gate, up):
        seen.append(float(gate.detach().abs().sum()))
        return gate * up

    g = torch.Generator().manual_seed(0)
    case = Case(
        "swiglu",
        "swiglu",
        "4x6",
        [torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)],
        [0, 1],
        {"peer": clobbering, "eager": recording},
        0,
        0,
    )
    time_backward(case, wall_timer(1), None, torch_bwd_variant=False)
    assert seen and seen[0] > 0 and float(case.inputs[0].abs().sum()) > 0


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="unknown op 'attention'; choose from rms_norm"):
        bench_pass(False, ops=["rope", "attention"], **SMALL)


def test_liger_without_the_op_is_noted_as_such(monkeypatch):
    """An importable Liger that lacks an op: the note says so (not Liger's version string)."""
    from hydra_kernels import bench_passes

    monkeypatch.setattr(bench_passes, "liger_peers", lambda: ({"rms_norm": hk.rms_norm_ref}, "0.6.0"))
    cases = bench_passes.kernel_cases(["rms_norm", "qk_norm"], 8, (16,), ((1, 4, 2, 8),),
                                      torch.device("cpu"), torch.float32, compile_peers=False)  # fmt: skip
    by_op = {c.op: c for c in cases}
    assert by_op["rms_norm"].impls["liger"] is hk.rms_norm_ref and not by_op["rms_norm"].notes
    assert by_op["qk_norm"].notes == {"liger": "Liger-Kernel has no qk_norm op with these semantics"}
