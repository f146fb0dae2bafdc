"""``analyze learning``: learning-rate and loss diagnostics of a run, from its metrics database.

* **warmup**: how many logged steps were in the warmup phase, whether the learning rate rose
  monotonically to its base, and whether the loss blew up while it did;
* **spikes**: logged losses above ``spike_factor`` × an EMA of the *previous* logged losses
  (SafeOptimizations' monitor uses the same kind of rule, at 2×);
* **plateaus**: stretches of at least ``plateau_frac`` of the run in which the short EMA of the loss
  improved by less than ``plateau_tol`` (relative), with the learning rate at the time;
* **clipping**: the share of logged steps whose gradient norm exceeded ``--grad_clip``;
* **divergence / overfitting**: the loss EMA ending above where it started; validation loss
  rising across the last evaluations while the training loss falls; skipped (non-finite) steps.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

from hydra_diag.run_db import load_run


@dataclass(frozen=True)
class LearningThresholds:
    spike_factor: float = 1.3
    ema_alpha: float = 0.8  # weight of the old EMA per logged row (rows are log intervals apart)
    plateau_frac: float = 0.15
    plateau_tol: float = 0.01
    clip_share_warning: float = 0.5
    warmup_blowup: float = 1.2  # loss during warmup above this × its first value


def find_spikes(
    steps: list[int], losses: list[float | None], factor: float, alpha: float
) -> list[dict[str, Any]]:
    """Losses above ``factor`` × the EMA of the preceding finite losses."""
    out, ema = [], None
    for s, v in zip(steps, losses, strict=True):
        if v is None or not math.isfinite(v):
            continue
        if ema is not None and v > factor * ema:
            out.append({"step": s, "loss": v, "reference": ema, "ratio": v / ema})
        ema = v if ema is None else alpha * ema + (1 - alpha) * v
    return out


def find_plateaus(
    steps: list[int], values: list[float | None], min_len: int, tol: float
) -> list[dict[str, Any]]:
    """Maximal stretches of ≥ ``min_len`` rows where every window of ``min_len`` rows improved by
    less than ``tol`` relative (a falling loss that slows down is not a plateau until it stalls)."""
    pts = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
    if min_len < 2 or len(pts) < min_len:
        return []
    flat = [False] * len(pts)
    for i in range(len(pts) - min_len + 1):
        first, last = pts[i][1], pts[i + min_len - 1][1]
        if first - last < tol * abs(first):
            for j in range(i, i + min_len):
                flat[j] = True
    out, i = [], 0
    while i < len(pts):
        if not flat[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(pts) and flat[j + 1]:
            j += 1
        out.append(
            {
                "start_step": pts[i][0],
                "end_step": pts[j][0],
                "loss_start": pts[i][1],
                "loss_end": pts[j][1],
                "rows": j - i + 1,
            }
        )
        i = j + 1
    return out


def analyze_learning(
    path: str,
    run_id: str | None = None,
    model: str | None = None,
    th: LearningThresholds = LearningThresholds(),
) -> dict[str, Any]:
    """Warmup, spikes, plateaus, clipping and divergence of one run (see the module docstring)."""
    data = load_run(path, run_id, model)
    steps = [s["step"] for s in data.steps]
    loss = [s["loss"] for s in data.steps]
    ema = [s["ema_short"] for s in data.steps]
    tc = data.train_config
    findings: list[dict[str, Any]] = []

    def add(sev, kind, msg, step=None):
        findings.append({"severity": sev, "kind": kind, "step": step, "message": msg})

    lr_rows = data.lr
    warm = [r for r in lr_rows if r.get("phase") == "warmup"]
    lrs = [r["lr"] for r in warm]
    warmup = {
        "configured_steps": tc.get("warmup_steps"),
        "max_steps": tc.get("max_steps"),
        "logged_rows": len(warm),
        "monotone": all(b >= a for a, b in itertools.pairwise(lrs)),
        "base_lr": lr_rows[0]["base_lr"] if lr_rows else None,
        "peak_lr": max((r["lr"] for r in lr_rows), default=None),
        "final_lr": lr_rows[-1]["lr"] if lr_rows else None,
    }
    if tc.get("warmup_steps") == 0 and len(loss) > 2:
        add("warning", "no_warmup", "the run has no warmup")
    if not warmup["monotone"]:
        add("error", "warmup_not_monotone", "the learning rate fell during warmup")
    warm_steps = {r["step"] for r in warm}
    warm_losses = [v for s, v in zip(steps, loss, strict=True) if s in warm_steps and v is not None]
    if len(warm_losses) >= 2 and max(warm_losses) > th.warmup_blowup * warm_losses[0]:
        add(
            "warning",
            "warmup_blowup",
            f"the loss rose to {max(warm_losses):.3f} during warmup from {warm_losses[0]:.3f}",
        )
    spikes = find_spikes(steps, loss, th.spike_factor, th.ema_alpha)
    for sp in spikes:
        add(
            "warning",
            "loss_spike",
            f"loss {sp['loss']:.3f} is {sp['ratio']:.2f}x its recent EMA {sp['reference']:.3f}",
            sp["step"],
        )
    min_len = max(3, math.ceil(th.plateau_frac * len(steps)))
    plateaus = find_plateaus(steps, ema, min_len, th.plateau_tol)
    lr_at = {r["step"]: r["lr"] for r in lr_rows}
    for p in plateaus:
        p["lr"] = lr_at.get(p["start_step"])
        at_end = (
            p["end_step"] == steps[-1]
            and warmup["final_lr"] is not None
            and warmup["base_lr"]
            and (warmup["final_lr"] <= 0.2 * warmup["base_lr"])
        )
        add(
            "info" if at_end else "warning",
            "plateau",
            f"steps {p['start_step']}–{p['end_step']}: EMA {p['loss_start']:.3f} -> {p['loss_end']:.3f}"
            + (" (lr already decayed)" if at_end else ""),
            p["start_step"],
        )
    clip = tc.get("grad_clip") or 0.0
    norms = [s["grad_norm"] for s in data.steps if s.get("grad_norm") is not None]
    clip_share = sum(n > clip for n in norms) / len(norms) if clip and norms else None
    if clip_share is not None and clip_share > th.clip_share_warning:
        add(
            "warning",
            "clipping",
            f"{clip_share:.0%} of logged steps clipped at {clip}: the lr may be too high",
        )
    finite_ema = [v for v in ema if v is not None and math.isfinite(v)]
    if len(finite_ema) >= 2 and finite_ema[-1] > finite_ema[0]:
        add(
            "error",
            "diverged",
            f"the loss EMA ended at {finite_ema[-1]:.3f}, above its start {finite_ema[0]:.3f}",
        )
    skipped = data.steps[-1]["skipped_steps"] if data.steps else 0
    if skipped:
        add("warning", "skipped_steps", f"{skipped} step(s) skipped as non-finite")
    ev = [e["val_loss"] for e in data.evals if e.get("val_loss") is not None]
    if len(ev) >= 3 and ev[-1] > ev[-2] > ev[-3] and len(finite_ema) >= 2 and finite_ema[-1] < finite_ema[0]:
        add(
            "warning",
            "overfitting",
            "validation loss rose over the last three evaluations while training loss fell",
        )
    return {
        "tool": "diagnose_learning",
        "run_id": data.run_id,
        "model_id": data.run.get("model_id"),
        "status": data.run.get("status"),
        "logged_steps": len(steps),
        "warmup": warmup,
        "spikes": spikes,
        "plateaus": plateaus,
        "clip_share": clip_share,
        "grad_clip": clip,
        "skipped_steps": skipped,
        "steps": steps,
        "loss": loss,
        "ema_short": ema,
        "lr": [lr_at.get(s) for s in steps],
        "grad_norm": [s.get("grad_norm") for s in data.steps],
        "evals": [{"step": e["step"], "val_loss": e["val_loss"]} for e in data.evals],
        "thresholds": asdict(th),
        "findings": findings,
    }


def render_learning(result: dict[str, Any], console) -> None:
    from hydra_diag.render import kv_table, print_findings, rows_table

    console.print(
        kv_table(
            f"learning diagnostics of run {result['run_id']} ({result['status']})",
            {
                "logged steps": result["logged_steps"],
                **{f"warmup {k}": v for k, v in result["warmup"].items()},
                "steps clipped": result["clip_share"],
                "skipped steps": result["skipped_steps"],
            },
            formats={"steps clipped": ".1%"},
        )
    )
    if result["spikes"]:
        console.print(rows_table("loss spikes", result["spikes"]))
    if result["plateaus"]:
        console.print(rows_table("plateaus", result["plateaus"]))
    print_findings(console, result["findings"], "learning findings")
