"""PNG figures (matplotlib, Agg backend: no display needed) drawn from the JSON-able results.

Each ``plot_<tool>(result, path)`` writes one PNG and returns its path. They read only the result
dict, so a figure can be redrawn from a saved ``--json`` output.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def new_figure(n_rows: int = 1, n_cols: int = 1, width: float = 7.0, height: float = 4.0, **kw):
    plt = _plt()
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False, **kw)
    return fig, axes


def save(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (folders created) and free it."""
    plt = _plt()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def finite_xy(xs: list[Any], ys: list[Any]) -> tuple[list[float], list[float]]:
    """Pairs where both values are finite numbers (None from JSON is dropped)."""
    out_x, out_y = [], []
    for x, y in zip(xs, ys, strict=False):
        if x is None or y is None:
            continue
        x, y = float(x), float(y)
        if math.isfinite(x) and math.isfinite(y):
            out_x.append(x)
            out_y.append(y)
    return out_x, out_y


def heatmap(
    ax,
    matrix: list[list[float | None]],
    row_labels: list[str],
    col_labels: list[str],
    title: str,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool = True,
):
    """A labelled heat map; cells with None are blank."""
    import numpy as np

    arr = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)
    im = ax.imshow(arr, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_yticks(range(len(row_labels)), labels=row_labels)
    ax.set_xticks(range(len(col_labels)), labels=col_labels, rotation=45 if len(col_labels) > 8 else 0)
    ax.set_title(title)
    if annotate and arr.size <= 200:
        lo, hi = im.get_clim()
        for i in range(arr.shape[0]):
            for j in range(arr.shape[1]):
                if np.isfinite(arr[i, j]):
                    bright = (arr[i, j] - lo) / (hi - lo) > 0.6 if hi > lo else False
                    ax.text(
                        j,
                        i,
                        f"{arr[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if bright else "white",
                    )
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return im
