"""loss_components.py: weights from the run's config, loss = CE + Σ w·aux checked, PNG written."""

from __future__ import annotations

import pytest

from hydra_diag.loss_components import analyze_loss_components

from .conftest import assert_png, invoke, last_error_line, run_json, synthetic_db


def test_cli_on_the_run(runner, tiny_run, tmp_path):
    png = tmp_path / "lc.png"
    out = run_json(runner, ["analyze", "loss-components", "--checkpoint_dir", tiny_run.folder, "--plot", png])
    assert_png(png)
    comps = {r["component"]: r for r in out["summary"]}
    # causal routing (the default) has no membership BCE terms (mod_router, mor_router)
    assert {"loss", "ce_loss", "moe_balance", "router_z"} <= set(comps)
    assert comps["moe_balance"]["weight"] == 0.01
    # the logged loss is exactly CE plus the weighted terms (float32 rounding only)
    assert out["max_abs_residual"] < 1e-4
    assert not any(f["kind"] == "loss_residual" for f in out["findings"])
    assert len(out["steps"]) == 8  # logged every 2 of 16 steps
    assert comps["loss"]["last"] == pytest.approx(out["series"]["loss"][-1])


def _rows(residual: float):
    rows = []
    for s in range(1, 11):
        ce = 5.0 - 0.1 * s
        aux = {"moe_balance": 1.0, "router_z": 0.5}
        rows.append(
            {
                "step": s,
                "loss": ce + 0.01 * 1.0 + 0.001 * 0.5 + (residual if s == 7 else 0.0),
                "ce_loss": ce,
                "aux_loss": 1.5,
                "aux": aux,
                "lr": 1e-3,
                "grad_norm": 0.5,
            }
        )
    return rows


def test_a_loss_not_made_of_its_terms_is_flagged(tmp_path):
    good = analyze_loss_components(str(synthetic_db(tmp_path / "a", _rows(0.0))))
    assert good["max_abs_residual"] < 1e-9 and not any(f["kind"] == "loss_residual" for f in good["findings"])
    bad = analyze_loss_components(str(synthetic_db(tmp_path / "b", _rows(0.2))))
    res = [f for f in bad["findings"] if f["kind"] == "loss_residual"]
    assert res and res[0]["step"] == 7
    share = {r["component"]: r["share_of_loss"] for r in good["summary"]}
    assert share["moe_balance"] == pytest.approx(0.01 / good["series"]["loss"][-1])


def test_dominating_aux_terms_warn(tmp_path):
    rows = [
        {
            "step": s,
            "loss": 1.0 + 0.01 * 50,
            "ce_loss": 1.0,
            "aux_loss": 50.0,
            "aux": {"moe_balance": 50.0},
            "lr": 1e-3,
            "grad_norm": 0.1,
        }
        for s in (1, 2, 3)
    ]
    out = analyze_loss_components(str(synthetic_db(tmp_path, rows)))
    assert any(f["kind"] == "aux_dominates" for f in out["findings"])


def test_missing_database_is_one_line(runner, tmp_path):
    res = invoke(runner, ["analyze", "loss-components", "--checkpoint_dir", tmp_path])
    assert res.exit_code == 1 and "no metrics database" in last_error_line(res)


def test_the_table_is_readable_at_80_columns(tmp_path):
    # nine columns did not fit: rich cut the component names to "route…", "moe_b…" (which term?)
    import io

    from rich.console import Console

    from hydra_diag.loss_components import render_loss_components
    from hydra_diag.output import jsonable

    aux = {"moe_balance": 1.0078123, "router_z": 7.1791234e-05, "mor_balance": 0.012345678}
    rows = [
        {"step": s, "loss": 5.123456 - s / 7, "ce_loss": 5.0123456 - s / 7, "aux": aux, "lr": 1e-3}
        for s in (1, 2, 3)
    ]
    out = jsonable(analyze_loss_components(str(synthetic_db(tmp_path, rows))))
    buf = io.StringIO()
    render_loss_components(out, Console(file=buf, width=80))
    text = buf.getvalue()
    assert "…" not in text, text
    for name in ("loss", "ce_loss", *aux):
        assert f" {name} " in text


def test_a_gpt_run_has_no_terms_to_weigh_and_is_checked(tmp_path):
    # the dense GPT logs no auxiliary terms: loss = CE is checkable, its config is not "missing"
    from hydra_model import gpt_config

    rows = [
        {"step": s, "loss": 5.0 - s / 10, "ce_loss": 5.0 - s / 10, "aux": {}, "lr": 1e-3} for s in (1, 2, 3)
    ]
    folder = synthetic_db(
        tmp_path,
        rows,
        model_config=gpt_config("tiny").to_dict(),
        train_config={"arch": "gpt", "warmup_steps": 1},
    )
    out = analyze_loss_components(str(folder))
    assert out["max_abs_residual"] == 0.0
    assert [f["kind"] for f in out["findings"]] == []
