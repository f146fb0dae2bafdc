"""watchdog.py and `hydra-diag moe watchdog`: a planted collapse is flagged; polling stops when it should."""

from __future__ import annotations

import math

from hydra_diag.watchdog import WatchThresholds, assess_moe_rows, watch_run

from .conftest import assert_png, invoke, run_json, synthetic_db


def _moe_row(step: int, util: list[float]) -> dict:
    n = len(util)
    ent = -sum(u * math.log(u) for u in util if u > 0)
    kl = sum(u * math.log(u * n) for u in util if u > 0)
    return {
        "step": step,
        "layer": 0,
        "utilization": util,
        "entropy": ent,
        "kl_to_uniform": kl,
        "max_violation": max(util) * n - 1,
    }


def _collapsing_run(folder, status="finished"):
    shares = [0.3, 0.45, 0.7, 0.95]
    moe = [
        _moe_row(2 * (i + 1), [s, (1 - s) / 3 * 1.9, (1 - s) / 3 * 1.05, (1 - s) / 3 * 0.05])
        for i, s in enumerate(shares)
    ]
    steps = [
        {"step": m["step"], "loss": 3.0, "ce_loss": 3.0, "aux_loss": 0.0, "aux": {}, "lr": 1e-3} for m in moe
    ]
    return synthetic_db(folder, steps, status=status, moe_rows=moe)


def test_planted_collapse_and_dead_experts(runner, tmp_path):
    folder = _collapsing_run(tmp_path)
    png = tmp_path / "wd.png"
    out = run_json(runner, ["moe", "watchdog", "--checkpoint_dir", folder, "--once", "--plot", png])
    assert_png(png)
    kinds = {a["kind"] for a in out["all_alerts"]}
    assert {"collapsed", "dead_expert"} <= kinds
    layer0 = out["layers"][0]
    assert layer0["dead_experts"] == [3] and layer0["max_share"] == 0.95
    assert out["polls"] == 1
    res = invoke(runner, ["moe", "watchdog", "--checkpoint_dir", folder, "--once", "--fail_on_alert"])
    assert res.exit_code == 1


def test_rising_share_warns_before_it_collapses():
    rows = [
        {**_moe_row(s, [u, (1 - u) / 3, (1 - u) / 3, (1 - u) / 3])}
        for s, u in ((2, 0.3), (4, 0.45), (6, 0.6))
    ]
    status, alerts = assess_moe_rows(rows, top_k=1, th=WatchThresholds())
    assert [a["kind"] for a in alerts] == ["collapsing"]
    assert status[0]["max_share_change"] == 0.6 - 0.3


def test_the_real_run_once(runner, tiny_run):
    out = run_json(runner, ["moe", "watchdog", "--checkpoint_dir", tiny_run.folder, "--once", "--no_plot"])
    assert out["run_status"] == "finished" and out["moe_enabled"] is True and out["last_step"] == 16
    assert [lay["layer"] for lay in out["layers"]] == [0, 1, 2]
    assert out["checkpoint"]["path"].endswith("hydra_tiny_final.pt")
    assert "plot" not in out


def test_polling_continues_while_the_run_is_running(tmp_path):
    folder = _collapsing_run(tmp_path, status="running")
    seen = []
    out = watch_run(str(folder), interval=0.0, max_polls=3, on_poll=lambda report, new: seen.append(len(new)))
    assert out["polls"] == 3
    assert seen[0] > 0 and seen[1:] == [0, 0]  # each alert is reported once
