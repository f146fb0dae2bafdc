"""The race's PNGs: validation loss against training time, tokens seen and executed FLOPs, one line
per configuration (solid: inference-mode routing; dashed, same colour: training-mode routing).
Drawn from the JSON document alone, so merged runs plot like one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra_diag.plots import finite_xy, new_figure, save

AXES = (
    ("time", "elapsed_s", "training time (s)", 1.0),
    ("tokens", "tokens", "tokens seen (M)", 1e-6),
    ("flops", "flops", "executed training FLOPs (PFLOP)", 1e-15),
)


def plot_race(doc: dict[str, Any], folder: Path) -> list[Path]:
    """``race_loss_vs_{time,tokens,flops}.png`` in ``folder``; returns their paths."""
    s = doc["settings"]
    out = []
    for name, key, label, scale in AXES:
        fig, axes = new_figure(width=7.5, height=4.5)
        ax = axes[0][0]
        for i, run in enumerate(doc["runs"]):
            color = f"C{i % 10}"
            evals = run.get("evals", [])
            # the step-0 point (the untrained model's loss, ln V) squashes the curves; start after it
            pts = [e for e in evals if e.get("steps", 0) > 0] or evals
            xs = [None if e.get(key) is None else e[key] * scale for e in pts]
            x, y = finite_xy(xs, [e.get("val_loss") for e in pts])
            ax.plot(x, y, "o-", color=color, label=f"{run['name']}")
            x2, y2 = finite_xy(xs, [e.get("val_loss_train_mode") for e in pts])
            if y2:
                ax.plot(x2, y2, "s--", color=color, alpha=0.7, label=f"{run['name']} (train-mode routing)")
        ax.set_xlabel(label)
        ax.set_ylabel("validation CE (nats/token)")
        ax.set_title(
            f"race, {s['model_size']}, {s['budget_s']:.0f} s each, batch {s['batch_size']}x{s['seq_len']}"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        out.append(save(fig, Path(folder) / f"race_loss_vs_{name}.png"))
    return out
