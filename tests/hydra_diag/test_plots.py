"""plots.py: the helpers behind every figure (finite pairs, labelled heat maps, saving)."""

from __future__ import annotations

import math

from hydra_diag.plots import finite_xy, heatmap, new_figure, save

from .conftest import assert_png


def test_finite_pairs():
    assert finite_xy([1, 2, 3, 4], [1.0, None, math.nan, 2.0]) == ([1.0, 4.0], [1.0, 2.0])


def test_heatmap_png(tmp_path):
    fig, axes = new_figure(1, 1)
    heatmap(axes[0][0], [[0.1, None], [0.9, 0.5]], ["r0", "r1"], ["c0", "c1"], "title", vmin=0, vmax=1)
    out = save(fig, tmp_path / "deep" / "h.png")
    assert_png(out)
