"""Figures of training runs: loss components, learning diagnostics, scaling fits, knob sweeps,
and the MoE watchdog's utilisation history."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hydra_diag.plots import finite_xy, new_figure, save


def plot_loss_components(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(2, 1, width=8, height=3.5)
    steps = result["steps"]
    ax = axes[0][0]
    for name in ("loss", "ce_loss"):
        x, y = finite_xy(steps, result["series"][name])
        ax.plot(x, y, label=name, lw=1.5)
    ev = result.get("evals") or []
    if ev:
        x, y = finite_xy([e["step"] for e in ev], [e["val_loss"] for e in ev])
        ax.plot(x, y, "o--", label="val_loss", ms=4)
    ax.set_ylabel("nats")
    ax.set_title(f"loss components, run {result['run_id']}")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    drew = False
    for name, vals in result["weighted"].items():
        x, y = finite_xy(steps, vals)
        pts = [(a, b) for a, b in zip(x, y, strict=True) if b > 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{name} × {result['weights'].get(name)}")
            drew = True
    if drew:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no weighted auxiliary terms", ha="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted contribution")
    return save(fig, path)


def plot_learning(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(2, 1, width=8, height=3.5)
    ax = axes[0][0]
    steps = result["steps"]
    x, y = finite_xy(steps, result["loss"])
    ax.plot(x, y, lw=1, alpha=0.6, label="loss")
    x, y = finite_xy(steps, result["ema_short"])
    ax.plot(x, y, lw=2, label="EMA 0.99")
    for p in result["plateaus"]:
        ax.axvspan(p["start_step"], p["end_step"], color="orange", alpha=0.2)
    if result["spikes"]:
        ax.plot(
            [s["step"] for s in result["spikes"]],
            [s["loss"] for s in result["spikes"]],
            "rx",
            ms=9,
            label="spike",
        )
    ax.set_ylabel("loss")
    ax.set_title(f"learning diagnostics, run {result['run_id']} (plateaus shaded)")
    ax.legend(loc="upper right", fontsize=8)
    twin = ax.twinx()
    x, y = finite_xy(steps, result["lr"])
    twin.plot(x, y, color="gray", ls=":", label="lr")
    twin.set_ylabel("learning rate", color="gray")
    ax = axes[1][0]
    x, y = finite_xy(steps, result["grad_norm"])
    ax.plot(x, y, lw=1)
    if result.get("grad_clip"):
        ax.axhline(result["grad_clip"], color="red", ls="--", lw=1, label=f"clip {result['grad_clip']}")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("grad norm (before clipping)")
    return save(fig, path)


def plot_scaling(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(1, 2, width=6, height=4.5)
    for ax, xkey, fit_key, pred_key, label in (
        (axes[0][0], "params", "fit_params", "prediction_by_params", "parameters"),
        (axes[0][1], "train_flops", "fit_compute", "prediction_by_compute", "training FLOPs"),
    ):
        runs = [r for r in result["runs"] if r.get("final_val_loss")]
        xs = [r[xkey] for r in runs]
        ys = [r["final_val_loss"] for r in runs]
        ax.loglog(xs, ys, "o", label="measured")
        for r in runs:
            ax.annotate(
                r["variant"],
                (r[xkey], r["final_val_loss"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        fit, pred = result[fit_key], result[pred_key]
        lo, hi = min(xs) / 2, max(pred["x"], max(xs)) * 2
        grid = [lo * (hi / lo) ** (i / 99) for i in range(100)]
        ax.loglog(
            grid,
            [fit["coefficient"] * g ** (-fit["exponent"]) for g in grid],
            "-",
            lw=1,
            label=f"L = {fit['coefficient']:.3g}·x^(−{fit['exponent']:.3f})",
        )
        if pred.get("pi"):
            ax.errorbar(
                [pred["x"]],
                [pred["y"]],
                yerr=[[pred["y"] - pred["pi"][0]], [pred["pi"][1] - pred["y"]]],
                fmt="s",
                color="red",
                capsize=4,
                label=f"{result['target_params'] / 1e9:.3g}B: {pred['y']:.3f} ({pred['level']:.0%} PI)",
            )
        else:
            ax.loglog([pred["x"]], [pred["y"]], "s", color="red", label=f"prediction {pred['y']:.3f}")
        ax.set_xlabel(label)
        ax.set_ylabel("final validation loss")
        ax.legend(fontsize=7)
    fig.suptitle(f"scaling: {result['steps']} steps, {result['dataset']}, {result['device']}")
    return save(fig, path)


def plot_knobs(result: dict[str, Any], path: Path) -> Path:
    knobs = list(result["knobs"])
    if result["design"] == "grid" or not knobs:
        fig, axes = new_figure(1, 1, width=max(6, 0.6 * len(result["runs"])), height=4)
        ax = axes[0][0]
        runs = [r for r in result["runs"] if r.get("final_val_loss") is not None]
        ax.bar(range(len(runs)), [r["final_val_loss"] for r in runs])
        ax.set_xticks(range(len(runs)), labels=[r["run"] for r in runs], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("final validation loss")
        return save(fig, path)
    fig, axes = new_figure(1, len(knobs), width=4.5, height=3.8)
    base = next((r for r in result["runs"] if r["run"] == "baseline"), None)
    for ax, name in zip(axes[0], knobs, strict=True):
        runs = [r for r in result["runs"] if name in r and r.get("final_val_loss") is not None]
        vals = [r[name] for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        xs = vals if numeric else list(range(len(vals)))
        ax.plot(xs, [r["final_val_loss"] for r in runs], "o-")
        if numeric and name == "lr" and all(v > 0 for v in vals):
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(xs, labels=[str(v) for v in vals])
        if base and base.get("final_val_loss") is not None:
            ax.axhline(base["final_val_loss"], color="gray", ls=":", label="baseline")
            ax.legend(fontsize=7)
        ax.set_xlabel(name)
        ax.set_ylabel("final validation loss")
    fig.suptitle(f"knob sweep: {result['model_size']}, {result['steps']} steps")
    return save(fig, path)


def plot_watchdog(result: dict[str, Any], path: Path) -> Path:
    hist = result.get("history") or []
    layers = sorted({h["layer"] for h in hist})
    fig, axes = new_figure(max(1, len(layers)), 1, width=8, height=2.6)
    if not layers:
        axes[0][0].text(
            0.5, 0.5, "no MoE routing rows logged yet", ha="center", transform=axes[0][0].transAxes
        )
        return save(fig, path)
    for ax, layer in zip((row[0] for row in axes), layers, strict=True):
        rows = sorted((h for h in hist if h["layer"] == layer), key=lambda h: h["step"])
        n = max(len(r["utilization"]) for r in rows)
        for e in range(n):
            ax.plot(
                [r["step"] for r in rows],
                [r["utilization"][e] if e < len(r["utilization"]) else math.nan for r in rows],
                label=f"expert {e}",
            )
        ax.axhline(1.0 / n, color="gray", ls=":", lw=1)
        ax.set_ylabel(f"layer {layer} share")
        ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=7, ncol=min(n, 8))
    axes[-1][0].set_xlabel("step")
    axes[0][0].set_title(f"expert utilisation, run {result.get('run_id')} (dotted: fair share)")
    return save(fig, path)
