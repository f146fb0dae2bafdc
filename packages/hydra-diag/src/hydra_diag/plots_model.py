"""Figures of a model's insides: routing heat maps per layer, gradient/activation norms per layer,
expert weight balance and specialisation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hydra_diag.plots import heatmap, new_figure, save


def plot_routing(result: dict[str, Any], path: Path) -> Path:
    panels = [k for k in ("mod", "mor", "moe") if result["eval"][k] or result["train"][k]]
    fig, axes = new_figure(1, max(1, len(panels)), width=5.5, height=4)
    if not panels:
        axes[0][0].text(
            0.5, 0.5, "no routed layers (dense model)", ha="center", transform=axes[0][0].transAxes
        )
        return save(fig, path)
    for ax, kind in zip(axes[0], panels, strict=True):
        if kind == "mod":
            layers = [r["layer"] for r in result["train"]["mod"]]
            cols = ["capacity", "train selected", "eval selected", "router p̄ (eval)"]
            ev = {r["layer"]: r for r in result["eval"]["mod"]}
            mat = [
                [
                    r.get("capacity"),
                    r.get("selected_frac"),
                    ev.get(r["layer"], {}).get("selected_frac"),
                    ev.get(r["layer"], {}).get("router_prob_mean"),
                ]
                for r in result["train"]["mod"]
            ]
            heatmap(ax, mat, [f"layer {x}" for x in layers], cols, "MoD: share of tokens", vmin=0, vmax=1)
        elif kind == "mor":
            rows = result["eval"]["mor"]
            width = max(len(r.get("depth_hist") or []) for r in rows)
            mat = [
                list(r.get("depth_hist") or []) + [None] * (width - len(r.get("depth_hist") or []))
                for r in rows
            ]
            mat.append(
                list(result["expected_depth_hist"]) + [None] * (width - len(result["expected_depth_hist"]))
            )
            heatmap(
                ax,
                mat,
                [f"layer {r['layer']}" for r in rows] + ["schedule"],
                [str(d) for d in range(width)],
                "MoR (eval): share of tokens by depth",
                vmin=0,
                vmax=1,
            )
            ax.set_xlabel("recursions run")
        else:
            rows = result["eval"]["moe"]
            width = max(len(r.get("utilization") or []) for r in rows)
            mat = [list(r.get("utilization") or []) for r in rows]
            heatmap(
                ax,
                mat,
                [f"layer {r['layer']}" for r in rows],
                [f"e{e}" for e in range(width)],
                f"MoE (eval): expert share (fair {1 / width:.2f})",
                vmin=0,
                vmax=1,
            )
    fig.suptitle(f"routing health: {result['source']}", fontsize=9)
    return save(fig, path)


def plot_deep_diagnosis(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(2, 1, width=9, height=3.6)
    ax = axes[0][0]
    grads = result["gradients"]
    comps = sorted({g["component"] for g in grads})
    wheres = list(dict.fromkeys(g["where"] for g in grads))
    width = 0.8 / max(len(comps), 1)
    for j, comp in enumerate(comps):
        xs, ys = [], []
        for i, w in enumerate(wheres):
            g = next((r for r in grads if r["where"] == w and r["component"] == comp), None)
            if (
                g is not None
                and g["grad_norm"] is not None
                and g["grad_norm"] > 0
                and math.isfinite(g["grad_norm"])
            ):
                xs.append(i + j * width)
                ys.append(g["grad_norm"])
        ax.bar(xs, ys, width=width, label=comp)
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wheres))], labels=wheres, rotation=30, fontsize=8)
    ax.set_ylabel("gradient L2 norm")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"deep diagnosis: {result['source']}", fontsize=9)
    ax = axes[1][0]
    blocks = result["activations"]["blocks"]
    xs = ["embed"] + [f"block {b['block']}" for b in blocks]
    ys = [result["activations"]["embedding_rms"]] + [b["output_rms"] for b in blocks]
    ax.plot(range(len(xs)), [y if y else math.nan for y in ys], "o-", label="residual stream RMS")
    for b in blocks:
        for r, u in enumerate(b["update_rms"] or []):
            ax.plot(
                1 + b["block"] + 0.1 * r,
                u if u else math.nan,
                "x",
                color="C1",
                label="update RMS" if (b["block"], r) == (0, 0) else None,
            )
    ax.set_xticks(range(len(xs)), labels=xs, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("RMS")
    ax.legend(fontsize=7)
    return save(fig, path)


def plot_weight_balance(result: dict[str, Any], path: Path) -> Path:
    layers = result["layers"]
    fig, axes = new_figure(1, 3, width=4.5, height=max(2.5, 0.5 * len(layers) + 1.5))
    labels = [f"layer {lay['layer']}" for lay in layers]
    n = max(len(lay["experts"]) for lay in layers)
    cols = [f"e{e}" for e in range(n)]
    for ax, key, title in (
        (axes[0][0], "gate_up_vs_median", "gate/up norm ÷ layer median"),
        (axes[0][1], "gate_up_vs_init", "gate/up norm ÷ initial"),
        (axes[0][2], "router_norm", "router row norm"),
    ):
        mat = [[e[key] for e in lay["experts"]] for lay in layers]
        heatmap(ax, mat, labels, cols, title, cmap="magma")
    fig.suptitle(f"expert weight balance: {result['source']}", fontsize=9)
    return save(fig, path)


def plot_specialization(result: dict[str, Any], path: Path) -> Path:
    layers = result["layers"]
    if result["mode"] == "inference":
        fig, axes = new_figure(1, 1, width=7, height=max(2.5, 0.5 * len(layers) + 1.5))
        n = max(len(lay["experts"]) for lay in layers)
        mat = [[e["share"] for e in lay["experts"]] for lay in layers]
        heatmap(
            axes[0][0],
            mat,
            [f"layer {lay['layer']} (purity {lay['token_purity'] or 0:.2f})" for lay in layers],
            [f"e{e}" for e in range(n)],
            f"expert share ({result['routing']} routing)",
            vmin=0,
            vmax=1,
        )
        return save(fig, path)
    shown = layers[:4]
    fig, axes = new_figure(2, len(shown), width=3.8, height=3.4)
    for j, lay in enumerate(shown):
        n = len(lay["expert_similarity"])
        names = [f"e{e}" for e in range(n)]
        heatmap(
            axes[0][j],
            lay["expert_similarity"],
            names,
            names,
            f"layer {lay['layer']}: expert cos",
            cmap="coolwarm",
            vmin=-1,
            vmax=1,
        )
        heatmap(
            axes[1][j],
            lay["router_similarity"],
            names,
            names,
            f"layer {lay['layer']}: router cos",
            cmap="coolwarm",
            vmin=-1,
            vmax=1,
        )
    fig.suptitle(f"expert specialization from weights: {result['source']}", fontsize=9)
    return save(fig, path)
