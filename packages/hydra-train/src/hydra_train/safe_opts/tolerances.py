"""How close an optimized pretest arm must stay to its reference arm (the safe default, or the
optimizations it runs on top of), and how much slower it may be.

Numerics. Both arms start from the same weights and see the same batches.

1. **Step-0 probe** (same weights, the first batch, forward + backward, no update). Each arm's
   loss L and full gradient vector g are compared with an fp32 reference (the safe defaults
   without autocast; computed in chunks of rows so that it fits where training fits):
   ``e = ‖g − g_ref‖ / ‖g_ref‖`` and ``l = |L − L_ref| / |L_ref|`` (when training itself runs in
   fp32, the reference differs from the default arm only by the chunking's summation order). An
   optimization passes when

       e_opt ≤ 2·e_default + u·√(2D)      and      l_opt ≤ 2·l_default + u

   the whole-model form of the kernel rule of :mod:`hydra_kernels.numerics` (at most twice the safe path's own
   distance from the high-precision result, plus a small absolute term). ``u`` is the unit
   roundoff of the training precision (bf16 2⁻⁸; fp32 2⁻²⁴·√n with n the probe's tokens, the
   growth of a reordered fp32 sum of n terms); D is the number of block applications (blocks ×
   recursions): a per-layer relative rounding of u accumulates like a random walk over D layers
   forward and D backward, hence √(2D). Top-k routing near its threshold can flip a token's
   selection when the rounding differs; the default arm flips against fp32 too, which the 2×
   factor absorbs.

   **FP8** (stated, looser): ``+ 2·u₈`` on the gradient bound and ``+ u₈/4`` on the loss bound,
   u₈ = 2⁻⁴ for E4M3 and 2⁻³ for E5M2: one FP8 rounding of every linear output (relative u₈)
   is the dominant new error, the gradients are bf16; the loss is a mean over many tokens, whose
   independent roundings mostly cancel, hence a quarter.

   Optimizations whose probe is by construction the default's own computation (CUDA graphs:
   eager until captured; 8-bit Adam and prefetching: no effect on a forward/backward) are judged
   on the trajectory only.

2. **Trajectory** (each step of the arm, full batches, optimizer updates):
   ``|L_opt(t) − L_ref(t)| / L_ref(t) ≤ (1 + t) · loss bound of step 0``: identical weights give
   the step-0 bound; every Adam update moves each weight by at most about lr whatever the gradient
   error, so the weights (and the loss) can drift apart at most linearly in the step count. Every
   loss and gradient norm must be finite.

3. **Static routing** computes a different function (soft routing): finite, and its step-0 loss
   within 2% of the dynamic default's (both start near ln V; 2% of ln 32000 is 0.2 nats). No
   gradient comparison, and its speed is recorded but not judged (every token through every
   block is expected to cost more; what it buys is fixed shapes).

Speed. Each arm runs ``warmup`` untimed steps (compilation, capture, autotuning), then ``steps``
timed ones with Python's garbage collector paused; each timed step (the batch fetch included) is
bracketed by device synchronisation and the median taken. On CUDA an optimization fails as
*slower* when its median exceeds the reference arm's by more than the margin
``max(5%, 3 × MAD/median of the reference arm's steps)``: an eager HYDRA step is bound by the
host launching thousands of small kernels, and its step time was measured to wander by up to
±8% between steps on an H100 (a CUDA-graph replay: ±0.5%), so a fixed 5% would call noise a
slowdown; three median absolute deviations of the reference is what the run itself says its
noise is. On a CPU timing is recorded but not judged unless asked for: a shared CPU's load
changes between arms by more than any margin that would still mean something, and a pretest must
not fail at random. When judged (tests), the margin is at least 25% and every timed step of the
optimized arm must be slower than the reference's median.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from hydra_train.safe_opts.fp8 import FP8_FORMATS

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp32": 2.0**-24}
CUDA_SLOW_MARGIN = 0.05
CPU_SLOW_MARGIN = 0.25
NOISE_MULT = 3.0  # margin in units of the reference arm's relative median absolute deviation
STATIC_LOSS_REL = 0.02


def training_roundoff(precision: str, probe_tokens: int) -> float:
    u = UNIT_ROUNDOFF[precision]
    if precision == "fp32":
        return u * math.sqrt(max(1, probe_tokens))
    return u


@dataclass(frozen=True)
class Bounds:
    grad_abs: float
    loss_abs: float
    fp8_grad: float = 0.0
    fp8_loss: float = 0.0
    grad_mult: float = 2.0

    def grad_bound(self, e_default: float, fp8: bool) -> float:
        return self.grad_mult * e_default + self.grad_abs + (self.fp8_grad if fp8 else 0.0)

    def loss_bound(self, l_default: float, fp8: bool) -> float:
        return self.grad_mult * l_default + self.loss_abs + (self.fp8_loss if fp8 else 0.0)


def bounds_for(precision: str, probe_tokens: int, depth: int, fp8_format: str = "e4m3") -> Bounds:
    u = training_roundoff(precision, probe_tokens)
    u8 = FP8_FORMATS[fp8_format][2]
    return Bounds(grad_abs=u * math.sqrt(2 * max(1, depth)), loss_abs=u, fp8_grad=2 * u8, fp8_loss=u8 / 4)


@dataclass
class ArmNumbers:
    """What an arm measured (floats, JSON-able)."""

    probe_grad_err: float | None = None  # e vs the fp32 reference
    probe_loss_err: float | None = None  # l vs the fp32 reference
    probe_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    finite: list[bool] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None


def judge_numerics(
    rule: str, compare_probe: bool, opt: ArmNumbers, ref: ArmNumbers, default: ArmNumbers, bounds: Bounds
) -> tuple[str | None, dict]:
    """(failure reason or None, the figures behind the verdict). ``ref`` is the arm the trajectory
    is compared with; ``default`` holds the safe default's step-0 errors."""
    info: dict = {}
    bad = [t for t, ok in enumerate(opt.finite) if not ok] + [
        t for t, v in enumerate(opt.losses) if not math.isfinite(v)
    ]
    if bad:
        return f"non-finite loss or gradients at pretest step {min(bad) + 1}", info
    fp8 = rule == "fp8"
    if rule == "mode":
        rel = abs(opt.probe_loss - default.probe_loss) / abs(default.probe_loss)
        info["loss_rel_vs_default"] = rel
        if not rel <= STATIC_LOSS_REL:  # a NaN loss compares False with anything: it fails
            return (
                f"step-0 loss {opt.probe_loss:.4f} vs {default.probe_loss:.4f} (>{STATIC_LOSS_REL:.0%})",
                info,
            )
        return None, info
    l_bound = bounds.loss_bound(default.probe_loss_err or 0.0, fp8)
    if compare_probe:
        e_bound = bounds.grad_bound(default.probe_grad_err or 0.0, fp8)
        info.update(
            grad_err=opt.probe_grad_err, grad_bound=e_bound, loss_err=opt.probe_loss_err, loss_bound=l_bound
        )
        # `not <=`: a NaN error (a non-finite step-0 probe) must fail, and `nan > bound` is False
        if not opt.probe_grad_err <= e_bound:
            return f"step-0 gradient error {opt.probe_grad_err:.3g} > bound {e_bound:.3g}", info
        if not opt.probe_loss_err <= l_bound:
            return f"step-0 loss error {opt.probe_loss_err:.3g} > bound {l_bound:.3g}", info
    worst = 0.0
    for t, (a, b) in enumerate(zip(opt.losses, ref.losses, strict=False)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel / (1 + t))
        if rel > (1 + t) * l_bound:
            info["trajectory_worst"] = worst
            return (
                f"loss at pretest step {t + 1}: {a:.5f} vs {b:.5f} (rel {rel:.3g} > {(1 + t) * l_bound:.3g})",
                info,
            )
    info["trajectory_worst_per_step"] = worst
    return None, info


#: how a FAIL for speed's reason starts (:func:`judge_speed`; :func:`failed_on_speed` reads it back)
SLOWER = "slower"


def failed_on_speed(result: dict) -> bool:
    """Whether a stored pretest result is a FAIL for speed (a verdict near its margin can move
    between runs, unlike an error or a numerics FAIL)."""
    return result.get("status") == "FAIL" and str(result.get("reason", "")).startswith(SLOWER)


def judge_speed(opt: ArmNumbers, ref: ArmNumbers, cuda: bool, judged: bool) -> tuple[str | None, dict]:
    a, b = opt.median_ms, ref.median_ms
    info = {"median_ms": a, "default_median_ms": b}
    if a is None or b is None or a <= 0:
        return None, info
    info["speedup"] = b / a
    if not judged:
        return None, info
    med = statistics.median(ref.step_ms)
    mad = statistics.median(abs(t - med) for t in ref.step_ms) / med
    margin = max(CUDA_SLOW_MARGIN if cuda else CPU_SLOW_MARGIN, NOISE_MULT * mad)
    info.update(margin=margin, default_mad=mad)
    if a > b * (1 + margin) and (cuda or min(opt.step_ms) > b):
        return f"{SLOWER}: {a:.1f} ms vs {b:.1f} ms per step (+{a / b - 1:.0%}, margin {margin:.0%})", info
    return None, info
