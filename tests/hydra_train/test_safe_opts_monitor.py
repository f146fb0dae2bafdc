"""Anomaly detectors against hand-computed EMAs, and the CPU readback."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_train.safe_opts.monitor import Detectors, EmaDetector, StepReadback
from hydra_train.safe_opts.registry import INF_GRAD, LOSS_SPIKE, NAN_GRAD, NAN_LOSS, THROUGHPUT_DROP


def ema_reference(values, alpha):
    """Bias-corrected EMA computed the long way: weights alpha^(n-1-i)(1-alpha), normalised."""
    n = len(values)
    w = [(1 - alpha) * alpha ** (n - 1 - i) for i in range(n)]
    return sum(wi * v for wi, v in zip(w, values, strict=True)) / sum(w)


def test_baseline_is_the_bias_corrected_ema():
    rng = torch.Generator().manual_seed(3)
    vals = (torch.rand(17, generator=rng, dtype=torch.float64) * 3 + 1).tolist()
    d = EmaDetector(threshold=100.0, alpha=0.98, min_count=0, above=True)
    for v in vals:
        assert d.check(v) is None
    assert d.baseline == pytest.approx(ema_reference(vals, 0.98), rel=1e-12)


def test_loss_spike_threshold_min_count_and_spikes_not_folded_in():
    det = Detectors(loss_spike_threshold=2.0, throughput_drop_threshold=0.5)
    for s in range(1, 10):  # 9 normal losses: below min_count, nothing is judged yet
        assert det.step_anomalies(s, 5.0, 1.0, True) == []
    assert det.step_anomalies(10, 50.0, 1.0, True) == []  # the 10th value is still only learned
    base = det.loss.baseline
    assert base == pytest.approx(ema_reference([5.0] * 9 + [50.0], 0.98))
    (a,) = det.step_anomalies(11, 2.01 * base, 1.0, True)
    assert a.kind == LOSS_SPIKE and a.baseline == pytest.approx(base) and det.loss.baseline == base
    assert det.step_anomalies(12, 1.99 * base, 1.0, True) == []


@pytest.mark.parametrize(
    "loss,gn,kind",
    [(1.0, math.nan, NAN_GRAD), (1.0, math.inf, INF_GRAD), (math.nan, 3.0, NAN_LOSS)],
)
def test_non_finite_kinds(loss, gn, kind):
    det = Detectors(2.0, 0.5)
    (a,) = det.step_anomalies(4, loss, gn, False)
    assert a.kind == kind and a.step == 4


def test_throughput_drop_folds_slow_intervals_and_skips_after_a_switch():
    det = Detectors(2.0, 0.5)
    assert det.interval_anomalies(1, 1000.0) == [] and det.interval_anomalies(2, 10.0) == []
    (a,) = det.interval_anomalies(3, 1.0)  # judged once two intervals are known
    assert a.kind == THROUGHPUT_DROP and a.baseline == pytest.approx(ema_reference([1000.0, 10.0], 0.9))
    det = Detectors(2.0, 0.5)
    for s in range(20):
        assert det.interval_anomalies(s, 1000.0) == []
    # a lasting 2.5x slowdown: folded into the EMA, it is flagged 4 times, then it is the new normal
    flagged = [bool(det.interval_anomalies(20 + k, 400.0)) for k in range(6)]
    assert flagged == [True, True, True, True, False, False]
    hist = [1000.0] * 20 + [400.0] * 6
    assert det.speed.baseline == pytest.approx(ema_reference(hist, 0.9))
    det.switched()
    assert det.interval_anomalies(30, 1.0) == []  # the interval of a switch is not judged
    assert det.interval_anomalies(31, 1.0)


def test_state_round_trip():
    det = Detectors(2.0, 0.5)
    for s, v in enumerate((4.0, 3.0, 2.5), 1):
        det.step_anomalies(s, v, 1.0, True)
    other = Detectors(2.0, 0.5)
    other.load_state_dict(det.state_dict())
    assert other.loss.baseline == det.loss.baseline and other.loss.count == 3


def test_cpu_readback_in_step_order():
    rb = StepReadback(torch.device("cpu"))
    for s in (1, 2, 3):
        rb.push(s, ("fa3",), torch.tensor(s * 1.5), torch.tensor(float(s)), torch.tensor(s != 2))
    got = rb.ready()
    assert [g[0] for g in got] == [1, 2, 3]
    assert got[1] == (2, ("fa3",), (3.0, 2.0, False))
    assert rb.ready() == []
