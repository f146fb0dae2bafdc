"""scaling.py and `hydra-diag analyze scaling`: three tiny variants trained through hydra-train on the
CPU, fits with intervals, the 4B prediction and its PNG."""

from __future__ import annotations

import math

import pytest

from hydra_diag.output import DiagError
from hydra_diag.scaling import parse_variant

from .conftest import assert_png, invoke, last_error_line, run_json


def test_parse_variant():
    assert parse_variant("tiny") == ("tiny", {})
    assert parse_variant("tiny:dim=64,n_heads=1") == ("tiny", {"dim": 64, "n_heads": 1})
    with pytest.raises(DiagError):
        parse_variant(":dim=3")


def test_cli_trains_fits_and_predicts(runner, tmp_path):
    png = tmp_path / "scaling.png"
    out = run_json(
        runner,
        [
            "analyze",
            "scaling",
            "--device",
            "cpu",
            "--steps",
            6,
            "--seq_len",
            16,
            "--variant",
            "tiny:dim=32",
            "--variant",
            "tiny:dim=64",
            "--variant",
            "tiny:dim=96",
            "--plot",
            png,
        ],
    )
    assert_png(png)
    runs = out["runs"]
    assert [r["variant"] for r in runs] == ["tiny:dim=32", "tiny:dim=64", "tiny:dim=96"]
    assert runs[0]["params"] < runs[1]["params"] < runs[2]["params"]
    for r in runs:
        assert r["tokens_seen"] == 6 * 4 * 16
        assert r["train_flops"] == pytest.approx(r["flops_per_token"] * r["tokens_seen"])
        assert math.isfinite(r["final_val_loss"])
    fit = out["fit_params"]
    # the fit reproduces the points it was given: a·N^(−α) at each N is the loss up to the residual
    for r in runs:
        assert math.log(fit["coefficient"] * r["params"] ** -fit["exponent"]) == pytest.approx(
            math.log(r["final_val_loss"]), abs=3 * fit["residual_std"] + 1e-9
        )
    pred = out["prediction_by_params"]
    assert pred["x"] == 4e9 and pred["ci"][0] <= pred["y"] <= pred["ci"][1] and pred["pi"][0] <= pred["ci"][0]
    assert out["prediction_by_compute"]["x"] == pytest.approx(out["target_compute"])


def test_one_variant_is_refused(runner):
    res = invoke(runner, ["analyze", "scaling", "--device", "cpu", "--variant", "tiny"])
    assert res.exit_code == 2 and "at least two variants" in last_error_line(res)  # a usage error


def _fake_runs(monkeypatch, losses: dict[str, float], params: dict[str, int] | None = None) -> list[str]:
    """Replace the training by fixed results (params from dim unless given); returns the calls."""
    import hydra_diag.short_runs as short_runs

    calls: list[str] = []

    def fake(*, label, settings, steps, **_kw):
        calls.append(label)
        n = (params or {}).get(label) or 1000 * settings["dim"] ** 2
        return {
            "params": n,
            "final_val_loss": losses[label],
            "first_val_loss": 6.0,
            "tokens_seen": 1024,
            "flops_per_token": 6.0 * n,
            "train_flops": 6.0 * n * 1024,
            "tokens_per_s": 1.0,
            "skipped_steps": 0,
        }

    monkeypatch.setattr(short_runs, "run_short_training", fake)
    return calls


VARIANTS = ["--variant", "tiny:dim=32", "--variant", "tiny:dim=64", "--variant", "tiny:dim=96"]
LOSSES = {"tiny:dim=32": 5.0, "tiny:dim=64": 4.5, "tiny:dim=96": 4.2}


@pytest.mark.parametrize("bad", [["--uncertainty", "jackknife"], ["--level", "90"], ["--level", "0"]])
def test_bad_interval_options_fail_before_any_training(runner, monkeypatch, bad):
    # they were checked only by the fit, after every variant had trained, and raised a traceback
    calls = _fake_runs(monkeypatch, LOSSES)
    res = invoke(runner, ["analyze", "scaling", "--device", "cpu", *VARIANTS, *bad, "--no_plot"])
    assert res.exit_code == 2 and bad[0] in res.stderr  # a usage error: the value alone is wrong
    assert calls == []


def test_a_diverged_variant_is_left_out_of_the_fit(runner, monkeypatch):
    _fake_runs(monkeypatch, {**LOSSES, "tiny:dim=96": math.nan})
    out = run_json(runner, ["analyze", "scaling", "--device", "cpu", *VARIANTS, "--no_plot"])
    assert out["fit_params"]["n"] == 2 and math.isfinite(out["fit_params"]["exponent"])
    _fake_runs(monkeypatch, {**LOSSES, "tiny:dim=64": math.nan, "tiny:dim=96": math.inf})
    res = invoke(runner, ["analyze", "scaling", "--device", "cpu", *VARIANTS, "--no_plot"])
    assert res.exit_code == 1 and "fewer than two" in last_error_line(res)


def test_variants_of_one_size_are_an_error_not_a_traceback(runner, monkeypatch):
    _fake_runs(monkeypatch, LOSSES, params={"tiny:dim=32": 5000, "tiny:dim=64": 5000, "tiny:dim=96": 5000})
    res = invoke(runner, ["analyze", "scaling", "--device", "cpu", *VARIANTS, "--no_plot"])
    assert res.exit_code == 1 and "different sizes" in last_error_line(res)


def test_a_target_below_one_billion_is_not_printed_as_0b(runner, monkeypatch):
    _fake_runs(monkeypatch, LOSSES)
    res = invoke(
        runner, ["analyze", "scaling", "--device", "cpu", *VARIANTS, "--target_params", 5e8, "--no_plot"]
    )
    text = " ".join(res.stdout.split())
    assert res.exit_code == 0 and "a 0.5B model" in text and "0B model" not in text
