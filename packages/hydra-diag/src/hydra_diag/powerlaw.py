"""Power-law fits ``y = a · x^(−α)`` by least squares in log space, with their uncertainty.

In logs the model is linear, ``ln y = c₀ + c₁ ln x`` with ``c₁ = −α``, so ordinary least squares
gives the estimate, and ``s² (XᵀX)⁻¹`` (``s²`` the residual variance on n − 2 degrees of freedom)
its covariance. Intervals for a prediction at x₀ use Student's t with n − 2 degrees of freedom:

* confidence interval of the fitted line: ``ŷ ± t · √(x₀ᵀ C x₀)``;
* prediction interval of a new observation: ``ŷ ± t · √(x₀ᵀ C x₀ + s²)``.

The alternative is a residual bootstrap (refit on the fitted values plus resampled residuals),
whose percentiles need no normality assumption. Two points fit exactly and leave no residual to
estimate uncertainty from: intervals are then None.

The t quantile comes from the regularised incomplete beta function (a continued fraction), so
nothing beyond numpy is needed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def _betacf(a: float, b: float, x: float, max_iter: int = 300, eps: float = 1e-15) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz evaluation)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(ln_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: float) -> float:
    """P(T ≤ t) for Student's t with ``dof`` degrees of freedom."""
    tail = 0.5 * betainc(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, dof: float) -> float:
    """The t value with P(T ≤ t) = p (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, dof) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, dof) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass
class PowerLawFit:
    """``y = coefficient · x^(−exponent)``, fitted on ``n`` points."""

    coefficient: float
    exponent: float
    log_coefficient: float
    exponent_se: float | None
    log_coefficient_se: float | None
    covariance: list[list[float]] | None  # of (ln a, c₁ = −α)
    residual_std: float | None
    r2: float | None
    n: int
    method: str = "covariance"
    bootstrap: list[list[float]] | None = None  # (c₀, c₁) draws when method == "bootstrap"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("bootstrap")
        return d

    def predict(self, x: float, level: float = 0.9) -> dict[str, Any]:
        """The fitted value at ``x`` with a ``level`` confidence interval of the line and a
        prediction interval for a new observation (None without residual degrees of freedom)."""
        lx = math.log(x)
        mean = self.log_coefficient - self.exponent * lx
        out: dict[str, Any] = {"x": x, "y": math.exp(mean), "level": level, "ci": None, "pi": None}
        dof = self.n - 2
        if self.method == "bootstrap" and self.bootstrap:
            draws = np.array([c0 + c1 * lx for c0, c1 in self.bootstrap])
            resid = self.residual_std or 0.0
            q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
            lo, hi = np.percentile(draws, q)
            rng = np.random.default_rng(0)
            noisy = draws + rng.normal(0.0, resid, size=draws.shape) if resid else draws
            plo, phi = np.percentile(noisy, q)
            out["ci"] = [math.exp(lo), math.exp(hi)]
            out["pi"] = [math.exp(plo), math.exp(phi)]
            return out
        if dof < 1 or self.covariance is None:
            return out
        cov = np.array(self.covariance)
        v = np.array([1.0, lx])
        var_mean = float(v @ cov @ v)
        t = t_quantile((1 + level) / 2, dof)
        half_ci = t * math.sqrt(max(var_mean, 0.0))
        half_pi = t * math.sqrt(max(var_mean, 0.0) + (self.residual_std or 0.0) ** 2)
        out["ci"] = [math.exp(mean - half_ci), math.exp(mean + half_ci)]
        out["pi"] = [math.exp(mean - half_pi), math.exp(mean + half_pi)]
        return out


def _ols(lx: np.ndarray, ly: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    design = np.stack([np.ones_like(lx), lx], axis=1)
    coef, *_ = np.linalg.lstsq(design, ly, rcond=None)
    return coef, design, ly - design @ coef


def fit_power_law(
    xs: list[float], ys: list[float], method: str = "covariance", n_boot: int = 2000, seed: int = 0
) -> PowerLawFit:
    """Least squares of ln y on ln x (see the module docstring); ``method`` covariance|bootstrap."""
    if method not in ("covariance", "bootstrap"):
        raise ValueError(f"method {method!r}: use covariance or bootstrap")
    # missing, non-positive and non-finite points (a diverged run's inf loss) are left out: one inf
    # in log space makes every coefficient NaN
    pts = [
        (float(x), float(y))
        for x, y in zip(xs, ys, strict=True)
        if x is not None and y is not None and 0 < x < math.inf and 0 < y < math.inf
    ]
    if len(pts) < 2:
        raise ValueError(f"a power-law fit needs at least 2 positive finite points, got {len(pts)}")
    lx = np.log([p[0] for p in pts])
    ly = np.log([p[1] for p in pts])
    if np.ptp(lx) == 0:
        raise ValueError("all x values are equal: the exponent is not identifiable")
    coef, design, resid = _ols(lx, ly)
    n, dof = len(pts), len(pts) - 2
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else None
    cov = s = None
    if dof >= 1:
        s2 = float((resid**2).sum()) / dof
        s = math.sqrt(s2)
        cov = (s2 * np.linalg.inv(design.T @ design)).tolist()
    boots = None
    if method == "bootstrap" and dof >= 1:
        rng = np.random.default_rng(seed)
        fitted = design @ coef
        # rescale residuals so their variance is s² (OLS residuals are shrunk by the fit)
        scaled = resid * math.sqrt(n / dof)
        boots = []
        for _ in range(n_boot):
            c, _, _ = _ols(lx, fitted + rng.choice(scaled, size=n, replace=True))
            boots.append([float(c[0]), float(c[1])])
    return PowerLawFit(
        coefficient=math.exp(coef[0]),
        exponent=-float(coef[1]),
        log_coefficient=float(coef[0]),
        exponent_se=math.sqrt(cov[1][1]) if cov else None,
        log_coefficient_se=math.sqrt(cov[0][0]) if cov else None,
        covariance=cov,
        residual_std=s,
        r2=r2,
        n=n,
        method=method if boots else "covariance",
        bootstrap=boots,
    )
