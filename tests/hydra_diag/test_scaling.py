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
    assert res.exit_code == 1 and "at least two variants" in last_error_line(res)
