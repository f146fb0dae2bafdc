"""hydra_kernels.bench_harness, the timing harness every kernel benchmark shares: the steps it
times, the rows it makes (errors, fallbacks, rates), the peers and the report it writes."""

import json

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import controls
from hydra_kernels.bench_harness import (
    FELL_BACK,
    add_rates,
    backward_step,
    fwd_bwd_step,
    peers,
    private_copy,
    timed_row,
    timer_for,
    wall_timer,
    write_report,
)


def test_fwd_bwd_step_clears_gradients_each_time():
    x = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(4, 3)
    step = fwd_bwd_step(lambda t: t * t, [x], g)
    step()
    step()
    torch.testing.assert_close(x.grad, 2 * x.detach() * g)  # not accumulated over the two calls
    w = torch.randn(3, requires_grad=True)
    fwd_bwd_step(lambda t: ((t * 2).sum(), "extra"), [w], None)()  # scalar loss, tuple output
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))


def test_backward_step_gives_the_autograd_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, requires_grad=True)
    w = torch.randn(7, generator=g, requires_grad=True)
    step = backward_step(hk.rms_norm_ref, [x, w, 1e-6], [0, 1])
    dx1, dw1 = step()
    dx2, dw2 = step()  # retain_graph: the same backward twice
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    assert dx1.shape == x.shape and dw1.shape == w.shape and dx1.abs().sum() > 0


def test_backward_step_matches_a_hand_gradient():
    """y = a * b: dL/da = g * b for the output gradient g the step drew."""
    a, b = torch.randn(6, requires_grad=True), torch.randn(6)
    torch.manual_seed(3)
    step = backward_step(lambda s, t: s * t, [a, b], [0])
    torch.manual_seed(3)
    g = torch.randn(6)  # the same draw as the step's randn_like
    (da,) = step()
    torch.testing.assert_close(da, g * b)


def test_private_copy_keeps_or_sets_requires_grad_and_shares_no_storage():
    x = torch.randn(3, requires_grad=True)
    c = private_copy(x)
    assert c.requires_grad and c.data_ptr() != x.data_ptr() and torch.equal(c, x)
    assert not private_copy(x, requires_grad=False).requires_grad
    pair = private_copy((x, torch.ones(2)))
    assert isinstance(pair, tuple) and pair[0].data_ptr() != x.data_ptr()
    assert private_copy(1.5) == 1.5 and private_copy(None) is None


def test_wall_timer_times_the_calls_after_a_warm_up_call():
    calls = []
    ms = wall_timer(repeats=3)(lambda: calls.append(1))
    assert len(calls) == 4 and ms >= 0
    assert timer_for(torch.device("cpu"), rep=50)(lambda: calls.append(1)) >= 0  # wall clock off CUDA


def test_rates_over_the_byte_floor_and_flops():
    row = {"ms": 2.0}
    add_rates(row, nbytes=4e9, flops=6e9, copy_tbps=4.0)
    assert row["gbps"] == pytest.approx(2000.0) and row["pct_copy"] == pytest.approx(50.0)
    assert row["tflops"] == pytest.approx(3.0)
    cpu = {"ms": 1.0}
    add_rates(cpu, nbytes=1e6, flops=0.0, copy_tbps=None)
    assert cpu["pct_copy"] is None and "tflops" not in cpu
    untimed = {"ms": None}
    add_rates(untimed, 1e6, 1e6, 1.0)
    assert untimed == {"ms": None}


def test_timed_row_records_a_failing_peer_instead_of_raising():
    def boom(_row):
        raise RuntimeError("peer broke")

    row = timed_row("swiglu", "4x4", "liger", "swiglu", boom, nbytes=100)
    assert row["ms"] is None and row["error"] == "RuntimeError: peer broke" and "gbps" not in row


def test_timed_row_marks_a_hydra_kernel_that_fell_back():
    def falls_back(row):
        row["extra"] = 1  # a measure may add figures of its own
        controls.record_fallback("swiglu", RuntimeError("simulated launch failure"))
        return 1.0

    controls.reset_fallback_counts()
    try:
        with pytest.warns(RuntimeWarning, match="simulated launch failure"):
            row = timed_row("swiglu", "4x4", "hydra packed", "swiglu", falls_back, 1000)
        assert row["error"] == FELL_BACK and row["ms"] == 1.0 and row["extra"] == 1
        peer = timed_row("swiglu", "4x4", "eager", "swiglu", falls_back, 1000)
        assert "error" not in peer  # only hydra's own kernels fall back
    finally:
        controls.reset_fallback_counts()


def test_peers_are_eager_compile_and_liger_when_it_has_the_op():
    def ref(x):
        return x

    liger_rms = object()
    impls, notes = peers("rms_norm", ref, {"rms_norm": liger_rms}, None)
    assert impls["eager"] is ref and "compile" in impls and impls["liger"] is liger_rms and not notes
    impls, notes = peers("qk_norm", ref, {"rms_norm": liger_rms}, None, with_compile=False)
    assert set(impls) == {"eager"} and notes == {
        "liger": "Liger-Kernel has no qk_norm op with these semantics"
    }
    _, notes = peers("rms_norm", ref, {}, "Liger-Kernel not importable (x)")
    assert notes == {"liger": "Liger-Kernel not importable (x)"}


def test_write_report_creates_folders_and_writes_dtypes_as_text(tmp_path):
    path = tmp_path / "a" / "b" / "bench.json"
    write_report({"dtype": torch.bfloat16, "rows": [{"ms": 1.5}]}, path)
    assert json.loads(path.read_text()) == {"dtype": "torch.bfloat16", "rows": [{"ms": 1.5}]}
