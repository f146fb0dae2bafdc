"""The pretest verdict rules: bounds from unit roundoff and depth, trajectory growth, speed."""

from __future__ import annotations

import math

import pytest

from hydra_train.safe_opts.tolerances import ArmNumbers, bounds_for, judge_numerics, judge_speed


def test_bounds_from_roundoff_and_depth():
    b = bounds_for("bf16", probe_tokens=2048, depth=32, fp8_format="e4m3")
    assert b.grad_abs == pytest.approx(2**-8 * 8)  # u · sqrt(2D), D = 32
    assert b.loss_abs == 2**-8
    assert b.fp8_grad == 2 * 2**-4 and b.fp8_loss == 2**-4 / 4
    f = bounds_for("fp32", probe_tokens=64, depth=2, fp8_format="e5m2")
    assert f.loss_abs == pytest.approx(2**-24 * 8)  # u · sqrt(n) for a reordered fp32 sum
    assert f.fp8_grad == 2 * 2**-3
    assert b.grad_bound(0.01, fp8=False) == pytest.approx(0.02 + 2**-5)
    assert b.grad_bound(0.01, fp8=True) == pytest.approx(0.02 + 2**-5 + 2**-3)


def arm(losses, grad_err=0.0, loss_err=0.0, finite=None, probe_loss=10.0):
    return ArmNumbers(
        probe_grad_err=grad_err,
        probe_loss_err=loss_err,
        probe_loss=probe_loss,
        losses=list(losses),
        grad_norms=[1.0] * len(losses),
        finite=finite or [True] * len(losses),
    )


B = bounds_for("bf16", 2048, 32)


def test_equivalent_passes_within_and_fails_outside_the_gradient_bound():
    default = arm([10.0, 9.9, 9.8], grad_err=0.02, loss_err=1e-3)
    ok = arm([10.0, 9.9, 9.8], grad_err=2 * 0.02 + B.grad_abs * 0.99)
    assert judge_numerics("equivalent", True, ok, default, default, B)[0] is None
    bad = arm([10.0, 9.9, 9.8], grad_err=2 * 0.02 + B.grad_abs * 1.01)
    reason, info = judge_numerics("equivalent", True, bad, default, default, B)
    assert reason.startswith("step-0 gradient error") and info["grad_bound"] == pytest.approx(
        0.04 + B.grad_abs
    )
    # fp8 gets its stated extra term
    assert judge_numerics("fp8", True, bad, default, default, B)[0] is None


def test_trajectory_bound_grows_linearly_with_the_step():
    default = arm([10.0] * 4, loss_err=0.0)
    l0 = B.loss_bound(0.0, False)
    within = arm([10.0 * (1 + 0.99 * (1 + t) * l0) for t in range(4)])
    assert judge_numerics("equivalent", False, within, default, default, B)[0] is None
    late = arm([10.0, 10.0, 10.0, 10.0 * (1 + 1.01 * 4 * l0)])
    assert "pretest step 4" in judge_numerics("equivalent", False, late, default, default, B)[0]


def test_non_finite_fails_whatever_else():
    default = arm([10.0] * 3)
    r = judge_numerics("mode", False, arm([10.0, math.nan, 10.0]), default, default, B)[0]
    assert r == "non-finite loss or gradients at pretest step 2"
    r = judge_numerics("equivalent", False, arm([10.0] * 3, finite=[True, True, False]), default, default, B)[
        0
    ]
    assert r.endswith("step 3")


def test_mode_rule_compares_the_step0_loss_only():
    default = arm([10.0] * 3)
    assert (
        judge_numerics("mode", False, arm([12.0] * 3, grad_err=5.0, probe_loss=10.15), default, default, B)[0]
        is None
    )
    assert "2%" in judge_numerics("mode", False, arm([10.0] * 3, probe_loss=10.25), default, default, B)[0]


def timed(ms):
    a = ArmNumbers()
    a.step_ms = list(ms)
    return a


def test_speed_margins():
    ref = timed([100.0, 100.0, 101.0])
    assert judge_speed(timed([104.0] * 3), ref, cuda=True, judged=True)[0] is None
    reason, info = judge_speed(timed([106.0] * 3), ref, cuda=True, judged=True)
    assert reason.startswith("slower: 106.0 ms vs 100.0 ms") and info["speedup"] == pytest.approx(100 / 106)
    assert judge_speed(timed([500.0] * 3), ref, cuda=False, judged=False)[0] is None  # CPU: recorded only
    # CPU, judged: beyond 25% and every step slower than the default's median
    assert judge_speed(timed([130.0, 99.0, 140.0]), ref, cuda=False, judged=True)[0] is None
    assert judge_speed(timed([130.0, 131.0, 140.0]), ref, cuda=False, judged=True)[0] is not None
