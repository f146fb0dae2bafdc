"""Figures of GPU measurements: throughput and VRAM sweeps, SwiGLU backward across shapes,
tall-skinny matmuls, the profiler's top kernels, and model-step throughput."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hydra_diag.plots import new_figure, save


def plot_throughput(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(1, 2, width=6, height=4)
    seqs = sorted({c["seq_len"] for c in result["cells"]})
    for s in seqs:
        cells = [c for c in result["cells"] if c["seq_len"] == s and "tokens_per_s" in c]
        if not cells:
            continue
        b = [c["batch_size"] for c in cells]
        axes[0][0].plot(b, [c["tokens_per_s"] for c in cells], "o-", label=f"T={s}")
        axes[0][1].plot(b, [c["peak_gib"] or math.nan for c in cells], "o-", label=f"T={s}")
    for ax, ylabel in ((axes[0][0], "tokens/s"), (axes[0][1], "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(f"throughput sweep: {result['model_size']} on {result['device']}")
    return save(fig, path)


def plot_vram(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(1, 1, width=7, height=4.5)
    ax = axes[0][0]
    pts = result["points"]
    fit = [p for p in pts if p.get("fits")]
    ax.plot([p["seq_len"] for p in fit], [p["peak_gib"] for p in fit], "o-", label="measured peak")
    ax.plot([p["seq_len"] for p in pts], [p["estimated_gib"] for p in pts], "--", label="analytic estimate")
    oom = [p for p in pts if p.get("fits") is False]
    if oom:
        ax.plot(
            [p["seq_len"] for p in oom], [p["estimated_gib"] for p in oom], "rx", ms=9, label="out of memory"
        )
    if result.get("device_total_gib"):
        ax.axhline(
            result["device_total_gib"],
            color="red",
            ls=":",
            label=f"device {result['device_total_gib']:.0f} GiB",
        )
    if result.get("longest_fitting_seq_len"):
        ax.axvline(
            result["longest_fitting_seq_len"],
            color="green",
            ls=":",
            label=f"longest that fits: {result['longest_fitting_seq_len']}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("GiB")
    ax.set_title(f"training memory vs sequence length: {result['model_size']}, batch {result['batch_size']}")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_swiglu_backward(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(1, 1, width=7, height=4.5)
    ax = axes[0][0]
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"] if r.get("ms")))
    for impl in impls:
        rows = sorted(
            (r for r in result["rows"] if r["impl"] == impl and r.get("ms")), key=lambda r: r["bytes"]
        )
        ax.plot([r["bytes"] / 2**20 for r in rows], [r["gbps"] for r in rows], "o-", label=impl, ms=3)
    if result.get("copy_tbps"):
        ax.axhline(result["copy_tbps"] * 1e3, color="gray", ls=":", label="copy bandwidth")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved by the backward (MiB)")
    ax.set_ylabel("GB/s over the byte floor")
    ax.set_title(f"SwiGLU backward on {result['device']}")
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_tall_skinny(result: dict[str, Any], path: Path) -> Path:
    fig, axes = new_figure(1, 2, width=6, height=4)
    keys = sorted({(r["m"], r["k"]) for r in result["rows"]})
    for m, k in keys:
        rows = sorted((r for r in result["rows"] if (r["m"], r["k"]) == (m, k)), key=lambda r: r["n"])
        axes[0][0].plot([r["n"] for r in rows], [r["tflops"] for r in rows], "o-", label=f"M={m} K={k}", ms=3)
        axes[0][1].plot([r["n"] for r in rows], [r["gbps"] for r in rows], "o-", label=f"M={m} K={k}", ms=3)
    axes[0][0].axhline(result["square_tflops"], color="gray", ls=":", label="square matmul")
    if result.get("copy_tbps"):
        axes[0][1].axhline(result["copy_tbps"] * 1e3, color="gray", ls=":", label="copy bandwidth")
    for ax, ylabel in ((axes[0][0], "TFLOP/s"), (axes[0][1], "GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (output columns)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(f"tall-skinny matmul [M,K]@[K,N] on {result['device']}")
    return save(fig, path)


def plot_profile_kernels(result: dict[str, Any], path: Path) -> Path:
    rows = result["top_kernels"][:15][::-1]
    fig, axes = new_figure(1, 1, width=10, height=max(3, 0.35 * len(rows) + 1))
    ax = axes[0][0]
    fams = list(dict.fromkeys(r["family"] for r in rows))
    colors = {f: f"C{i}" for i, f in enumerate(fams)}
    ax.barh(range(len(rows)), [r["per_step_ms"] for r in rows], color=[colors[r["family"]] for r in rows])
    ax.set_yticks(range(len(rows)), labels=[r["kernel"][:48] for r in rows], fontsize=7)
    for f, c in colors.items():
        ax.barh([0], [0], color=c, label=f)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("ms per training step")
    ax.set_title(
        f"top kernels: {result['model_size']} B={result['batch_size']} T={result['seq_len']} "
        f"({result['device']})"
    )
    return save(fig, path)
