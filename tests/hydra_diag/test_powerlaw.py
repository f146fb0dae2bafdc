"""powerlaw.py: the fit recovers known exponents, its intervals cover the truth at their level, and the
Student-t quantiles match published table values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hydra_diag.powerlaw import betainc, fit_power_law, t_cdf, t_quantile


@pytest.mark.parametrize(
    ("p", "dof", "table"),
    [
        (0.975, 1, 12.7062),
        (0.975, 2, 4.3027),
        (0.95, 3, 2.3534),
        (0.975, 10, 2.2281),
        (0.995, 5, 4.0321),
        (0.975, 1000, 1.9623),
    ],
)
def test_t_quantiles_match_tables(p, dof, table):
    assert t_quantile(p, dof) == pytest.approx(table, abs=2e-4)
    assert t_quantile(1 - p, dof) == pytest.approx(-table, abs=2e-4)


def test_t_cdf_and_betainc_closed_forms():
    # dof 1 is the Cauchy distribution; I_x(1, 1) = x; I_x(a, 1) = x^a
    for t in (-3.0, -0.5, 0.0, 0.7, 10.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    for x in (0.1, 0.5, 0.93):
        assert betainc(1, 1, x) == pytest.approx(x)
        assert betainc(2.5, 1, x) == pytest.approx(x**2.5)


def test_noiseless_data_is_recovered_exactly():
    x = np.array([1e6, 3e6, 1e7, 5e7])
    y = 27.0 * x**-0.0763
    fit = fit_power_law(x, y)
    assert fit.exponent == pytest.approx(0.0763, rel=1e-9)
    assert fit.coefficient == pytest.approx(27.0, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    pred = fit.predict(4e9)
    assert pred["y"] == pytest.approx(27.0 * 4e9**-0.0763, rel=1e-9)
    assert pred["ci"][0] == pytest.approx(pred["y"]) and pred["ci"][1] == pytest.approx(pred["y"])


def test_confidence_intervals_cover_the_truth_at_their_level():
    """Over many noisy datasets, the 90% interval of the fitted line at 4e9 contains the true value
    about 90% of the time (exact under the model's Gaussian noise in log space)."""
    rng = np.random.default_rng(7)
    x = np.array([2e6, 8e6, 3e7, 1e8, 4e8])
    a, alpha, sigma = 15.0, 0.09, 0.03
    truth = a * 4e9**-alpha
    trials, hits, exps = 400, 0, []
    for _ in range(trials):
        y = a * x**-alpha * np.exp(rng.normal(0, sigma, x.size))
        fit = fit_power_law(x, y)
        exps.append(fit.exponent)
        lo, hi = fit.predict(4e9, level=0.9)["ci"]
        hits += lo <= truth <= hi
    assert 0.85 <= hits / trials <= 0.95
    assert np.mean(exps) == pytest.approx(alpha, abs=0.005)


def test_bootstrap_agrees_with_the_covariance_interval():
    rng = np.random.default_rng(1)
    x = np.logspace(6, 9, 8)
    y = 20 * x**-0.08 * np.exp(rng.normal(0, 0.02, x.size))
    cov = fit_power_law(x, y)
    boot = fit_power_law(x, y, method="bootstrap", n_boot=1000)
    assert boot.method == "bootstrap" and boot.exponent == pytest.approx(cov.exponent)
    c_lo, c_hi = cov.predict(4e9)["ci"]
    b_lo, b_hi = boot.predict(4e9)["ci"]
    # the same order of width (the bootstrap has no t-tail, so it is somewhat narrower)
    assert 0.3 < (b_hi - b_lo) / (c_hi - c_lo) < 1.5


def test_two_points_fit_but_give_no_interval_and_bad_input_raises():
    fit = fit_power_law([1e6, 1e7], [4.0, 3.0])
    assert fit.predict(1e9)["ci"] is None and fit.exponent_se is None
    with pytest.raises(ValueError):
        fit_power_law([1e6], [3.0])
    with pytest.raises(ValueError):
        fit_power_law([1e6, 1e6, 1e6], [3.0, 2.9, 3.1])


@pytest.mark.parametrize("bad", [(2e6, math.inf), (math.inf, 4.5), (2e6, math.nan), (math.nan, 4.5)])
def test_a_non_finite_point_is_left_out_not_a_nan_fit(bad):
    # a diverged run's loss (inf) used to turn every coefficient of the fit into NaN, silently
    xs, ys = [1e6, 4e6, 8e6], [5.0, 4.1, 3.8]
    want = fit_power_law(xs, ys)
    got = fit_power_law([bad[0], *xs], [bad[1], *ys])
    assert got.n == 3
    assert got.exponent == pytest.approx(want.exponent) and math.isfinite(got.exponent)
    assert got.coefficient == pytest.approx(want.coefficient)
