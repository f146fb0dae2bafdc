"""learning.py: planted spikes, plateaus, divergence and clipping are found where they were planted."""

from __future__ import annotations

import math

from hydra_diag.learning import analyze_learning, find_plateaus, find_spikes

from .conftest import assert_png, run_json, synthetic_db


def test_find_spikes_uses_the_previous_ema_only():
    steps = list(range(10))
    losses = [5.0, 4.5, 4.2, 4.0, 3.9, 8.0, 3.8, 3.7, None, 3.6]
    spikes = find_spikes(steps, losses, factor=1.3, alpha=0.8)
    assert [s["step"] for s in spikes] == [5]
    assert find_spikes(steps, [5.0, 4.0, 3.0, 2.0, 1.5, 1.2, 1.0, 0.9, 0.8, 0.7], 1.3, 0.8) == []


def test_find_plateaus_merges_windows():
    steps = list(range(20))
    vals = [10 - i for i in range(8)] + [2.0] * 8 + [1.5, 1.0, 0.5, 0.2]
    plateaus = find_plateaus(steps, vals, min_len=4, tol=0.01)
    assert len(plateaus) == 1
    assert (plateaus[0]["start_step"], plateaus[0]["end_step"]) == (8, 15)  # the eight 2.0 values
    assert find_plateaus(steps, [10 - 0.4 * i for i in range(20)], 4, 0.01) == []


def _planted_rows():
    rows = []
    for s in range(1, 41):
        loss = 6.0 * math.exp(-s / 8) + 2.0 if s < 25 else 2.0 + 6.0 * math.exp(-25 / 8)  # flat from 25 on
        if s == 15:
            loss *= 2.0  # the spike
        ema = 6.0 * math.exp(-(s - 3) / 8) + 2.0 if s < 28 else 2.0 + 6.0 * math.exp(-25 / 8)
        rows.append(
            {
                "step": s,
                "loss": loss,
                "ce_loss": loss,
                "aux_loss": 0.0,
                "aux": {},
                "lr": min(1.0, s / 5) * 1e-3,
                "grad_norm": 2.0 if s % 2 else 0.5,
                "ema_short": ema,
                "skipped_steps": 0,
                "lr_phase": "warmup" if s <= 5 else "cosine",
                "base_lr": 1e-3,
            }
        )
    return rows


def test_planted_problems_found_in_a_synthetic_run(tmp_path, runner):
    folder = synthetic_db(tmp_path, _planted_rows())
    out = analyze_learning(str(folder))
    assert [s["step"] for s in out["spikes"]] == [15]
    assert (
        out["plateaus"] and out["plateaus"][-1]["end_step"] == 40 and out["plateaus"][-1]["start_step"] >= 25
    )
    assert out["clip_share"] == 0.5  # odd steps had norm 2.0 > clip 1.0
    assert out["warmup"]["logged_rows"] == 5 and out["warmup"]["monotone"] is True
    kinds = {f["kind"] for f in out["findings"]}
    assert {"loss_spike", "plateau"} <= kinds and "diverged" not in kinds
    png = tmp_path / "learning.png"
    res = run_json(runner, ["analyze", "learning", "--checkpoint_dir", folder, "--plot", png])
    assert_png(png)
    assert res["spikes"] == out["spikes"]


def test_divergence_is_an_error(tmp_path):
    rows = [
        {
            "step": s,
            "loss": 3.0 + s,
            "ce_loss": 3.0 + s,
            "aux_loss": 0.0,
            "aux": {},
            "lr": 1e-3,
            "grad_norm": 0.5,
            "ema_short": 3.0 + s,
            "skipped_steps": 2,
        }
        for s in range(1, 8)
    ]
    out = analyze_learning(str(synthetic_db(tmp_path, rows)))
    kinds = {f["kind"]: f["severity"] for f in out["findings"]}
    assert kinds["diverged"] == "error" and "skipped_steps" in kinds


def test_cli_on_the_run(runner, tiny_run, tmp_path):
    png = tmp_path / "l.png"
    out = run_json(runner, ["analyze", "learning", "--checkpoint_dir", tiny_run.folder, "--plot", png])
    assert_png(png)
    assert out["logged_steps"] == 8 and out["warmup"]["configured_steps"] == 2
    assert out["status"] == "finished"
