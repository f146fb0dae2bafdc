"""``analyze loss-components``: cross-entropy and every auxiliary term of a run, from its metrics DB.

hydra-train logs the unweighted auxiliary terms (``aux``: mod_router, mor_router, router_z,
ponder, mor_balance, moe_balance — whichever exist) beside ``loss`` (what was backpropagated) and
``ce_loss``. The weights come from the run's own model config (``hydra_model.aux_loss_weights``), so
each term's *contribution* to the loss is known, and ``loss − ce − Σ weight·term`` must vanish: a
residual says the log and the model disagree about how the loss is made.

Findings: auxiliary terms holding a large share of the loss at the end, a term that grows while
the cross-entropy falls, non-finite values, and a residual above tolerance.
"""

from __future__ import annotations

import math
from typing import Any

from hydra_diag.run_db import RunData, load_run

AUX_SHARE_WARNING = 0.2
RESIDUAL_TOLERANCE = 1e-3  # relative to the loss


def _finite(v: Any) -> bool:
    return v is not None and math.isfinite(float(v))


def component_series(data: RunData) -> dict[str, list[tuple[int, float | None]]]:
    """(step, value) per component: ``loss``, ``ce_loss`` and each unweighted aux term."""
    names = sorted({k for s in data.steps for k in s["aux"]})
    out: dict[str, list[tuple[int, float | None]]] = {"loss": [], "ce_loss": []}
    for n in names:
        out[n] = []
    for s in data.steps:
        out["loss"].append((s["step"], s["loss"]))
        out["ce_loss"].append((s["step"], s["ce_loss"]))
        for n in names:
            out[n].append((s["step"], s["aux"].get(n)))
    return out


def analyze_loss_components(path: str, run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Per-component summary, weighted contributions over steps, consistency residual, findings."""
    from hydra_model import aux_loss_weights

    data = load_run(path, run_id, model)
    cfg = data.model_config()
    weights = aux_loss_weights(cfg) if cfg is not None else {}
    # the dense GPT baseline has no auxiliary terms (and no HydraConfig): its loss must equal CE
    dense = cfg is None and data.arch == "gpt"
    series = component_series(data)
    findings: list[dict[str, Any]] = []

    def add(sev, kind, msg, step=None):
        findings.append({"severity": sev, "kind": kind, "step": step, "message": msg})

    if not data.steps:
        add("error", "no_steps", f"run {data.run_id} has no logged steps")
    summary = []
    last_loss = data.steps[-1]["loss"] if data.steps else None
    for name, pts in series.items():
        vals = [v for _, v in pts if _finite(v)]
        bad = [s for s, v in pts if v is not None and not math.isfinite(float(v))]
        w = 1.0 if name in ("loss", "ce_loss") else weights.get(name)
        row = {
            "component": name,
            "weight": w,
            "first": vals[0] if vals else None,
            "last": vals[-1] if vals else None,
            "min": min(vals) if vals else None,
            "max": max(vals) if vals else None,
            "mean": sum(vals) / len(vals) if vals else None,
            "weighted_last": (w * vals[-1]) if vals and w is not None else None,
        }
        is_aux = name not in ("loss", "ce_loss")
        row["share_of_loss"] = (
            row["weighted_last"] / last_loss
            if is_aux and row["weighted_last"] is not None and last_loss
            else None
        )
        summary.append(row)
        if bad:
            add("error", "nonfinite", f"{name} is not finite at {len(bad)} logged step(s)", bad[0])
    aux_rows = [r for r in summary if r["component"] not in ("loss", "ce_loss")]
    total_share = sum(r["share_of_loss"] or 0.0 for r in aux_rows)
    if total_share > AUX_SHARE_WARNING:
        add("warning", "aux_dominates", f"auxiliary terms are {total_share:.0%} of the final loss")
    ce = next(r for r in summary if r["component"] == "ce_loss")
    for r in aux_rows:
        if (
            _finite(r["first"])
            and _finite(r["last"])
            and r["weight"]
            and r["last"] > 2 * abs(r["first"]) + 1e-6
            and _finite(ce["first"])
            and _finite(ce["last"])
            and ce["last"] < ce["first"]
        ):
            add(
                "warning",
                "aux_grows",
                f"{r['component']} grew {r['first']:.4g} -> {r['last']:.4g} while CE fell",
            )
    residuals = []
    if cfg is not None or dense:
        for s in data.steps:
            if not (_finite(s["loss"]) and _finite(s["ce_loss"])):
                continue
            rec = s["ce_loss"] + sum(weights.get(k, 0.0) * v for k, v in s["aux"].items() if _finite(v))
            residuals.append((s["step"], s["loss"] - rec))
        worst = max(residuals, key=lambda t: abs(t[1]), default=None)
        if worst is not None and last_loss and abs(worst[1]) > RESIDUAL_TOLERANCE * abs(last_loss):
            add(
                "error",
                "loss_residual",
                f"loss − ce − Σ weight·aux = {worst[1]:.3g}: the logged loss is not made of the logged terms",
                worst[0],
            )
    else:
        add("warning", "no_model_config", "the database has no model config for this run; weights unknown")
    weighted = {
        name: [(s, (weights.get(name) or 0.0) * v if _finite(v) else None) for s, v in pts]
        for name, pts in series.items()
        if name not in ("loss", "ce_loss")
    }
    return {
        "tool": "loss_component_diagnostic",
        "run_id": data.run_id,
        "model_id": data.run.get("model_id"),
        "weights": weights,
        "summary": summary,
        "steps": [s for s, _ in series["loss"]],
        "series": {k: [v for _, v in pts] for k, pts in series.items()},
        "weighted": {k: [v for _, v in pts] for k, pts in weighted.items()},
        "evals": [{"step": e["step"], "val_loss": e["val_loss"]} for e in data.evals],
        "max_abs_residual": max((abs(r) for _, r in residuals), default=None),
        "findings": findings,
    }


def render_loss_components(result: dict[str, Any], console) -> None:
    from hydra_diag.render import fmt, print_findings, rows_table

    # min and max stay in --json: with them the nine columns overflow 80 and rich cut the names
    console.print(
        rows_table(
            f"loss components of run {result['run_id']} ({len(result['steps'])} logged steps; "
            f"max |loss − ce − Σw·aux| = {fmt(result['max_abs_residual'], '.3g')})",
            result["summary"],
            ["component", "weight", "first", "last", "mean", "weighted_last", "share_of_loss"],
            formats={"share_of_loss": ".2%"},
            headers={"weighted_last": "w·last", "share_of_loss": "share"},
        )
    )
    print_findings(console, result["findings"], "loss-component findings")
