"""``sweep knobs``: short training runs over hyperparameter values (lr, MoD capacity, recursions …).

A knob is ``NAME=V1,V2,...`` where NAME is a hydra-train TrainConfig field (``lr``,
``warmup_steps``, ``batch_size``, ``grad_clip`` …) or a HydraConfig field (``mod_capacity``,
``recursions_per_block``, ``moe_num_experts`` …). One-at-a-time by default: a baseline run with every
knob at its default, then one run per value with only that knob changed. ``grid=True`` runs the
full cartesian product instead. Every run uses the same data, steps, batch and seed, through
hydra-train's loop; the result ranks them by final validation loss.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any

import torch

from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress

DEFAULT_KNOBS = ("lr=0.001,0.003,0.01", "mod_capacity=0.5,0.75,1.0")


def parse_knob(spec: str) -> tuple[str, list[Any]]:
    """``"lr=1e-3,3e-3"`` → ``("lr", [0.001, 0.003])`` (values parsed as JSON, else kept as text)."""
    name, sep, raw = spec.partition("=")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not name.strip() or not values:
        raise DiagUsageError(f"--knob {spec!r}: expected NAME=V1,V2,... e.g. lr=1e-3,3e-3")
    parsed = []
    for v in values:
        try:
            parsed.append(json.loads(v))
        except json.JSONDecodeError:
            parsed.append(v)
    return name.strip(), parsed


def plan_runs(knobs: list[tuple[str, list[Any]]], grid: bool) -> list[dict[str, Any]]:
    """The settings of every run: the grid's product, or a baseline plus one change per value."""
    if grid:
        names = [k for k, _ in knobs]
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(v for _, v in knobs))]
    runs: list[dict[str, Any]] = [{}]
    for name, values in knobs:
        runs += [{name: v} for v in values]
    return runs


def _label(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def sweep_knobs(
    knobs: list[str] | None = None,
    model_size: str | None = None,
    base: dict[str, Any] | None = None,
    steps: int | None = None,
    grid: bool = False,
    dataset: str = "synthetic",
    vocab_size: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str = "auto",
    seed: int = 1337,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run the sweep (see the module docstring); ``base`` settings apply to every run. Every run's
    settings are checked before the first trains (a bad value is a DiagUsageError); a run that
    fails anyway (the device, the data) is a row with its error."""
    from hydra_diag.short_runs import check_short_run, check_value_types, run_short_training

    cuda = torch.cuda.is_available() and device != "cpu"
    parsed = [parse_knob(k) for k in (knobs or DEFAULT_KNOBS)]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise DiagUsageError(f"a knob is named twice: {names}")
    model_size = model_size or ("debug" if cuda else "tiny")
    base = dict(base or ({} if cuda else {"dim": 64, "n_mor_blocks": 3}))
    steps = steps or (100 if cuda else 12)
    shape = dict(
        model_size=model_size,
        steps=steps,
        dataset=dataset,
        vocab_size=vocab_size or (32000 if cuda else 512),
        seq_len=seq_len or (512 if cuda else 32),
        batch_size=batch_size or (8 if cuda else 4),
        device=device,
        seed=seed,
    )
    check_value_types(base, "--set")
    for name, values in parsed:
        for v in values:
            check_value_types({name: v}, "--knob")
    plan = plan_runs(parsed, grid)
    for setting in plan:  # the baseline ({}: the preset and --set alone) first, unprefixed
        what = f"--knob {_label(setting)}" if setting else ""
        check_short_run(what, settings={**base, **setting}, **shape)
    results = []
    for i, setting in enumerate(plan):
        label = _label(setting) or "baseline"
        progress(f"run {i + 1}/{len(plan)}: {label}")
        t0 = time.perf_counter()
        try:
            s = run_short_training(settings={**base, **setting}, label=label, progress=progress, **shape)
            row = {
                "run": label,
                **setting,
                "final_val_loss": s.get("final_val_loss"),
                "first_val_loss": s.get("first_val_loss"),
                "final_loss": s.get("final_loss"),
                "tokens_per_s": s.get("tokens_per_s"),
                "skipped_steps": s.get("skipped_steps"),
                "params": s.get("params"),
                "error": None,
            }
        except DiagError as exc:  # a setting the model refuses is a result of the sweep, not a crash
            row = {"run": label, **setting, "final_val_loss": None, "error": str(exc)}
        row["wall_s"] = time.perf_counter() - t0
        results.append(row)
    ok = [r for r in results if r.get("final_val_loss") is not None and math.isfinite(r["final_val_loss"])]
    best = min(ok, key=lambda r: r["final_val_loss"]) if ok else None
    return {
        "tool": "sweep_training_knobs",
        "model_size": model_size,
        "base": base,
        "steps": steps,
        "design": "grid" if grid else "one-at-a-time",
        "knobs": {n: v for n, v in parsed},
        "runs": results,
        "best": best,
    }


def render_knobs(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    cols = ["run", "final_val_loss", "first_val_loss", "tokens_per_s", "skipped_steps", "wall_s", "error"]
    ranked = sorted(
        result["runs"], key=lambda r: (r.get("final_val_loss") is None, r.get("final_val_loss") or 0)
    )
    console.print(
        rows_table(
            f"knob sweep ({result['design']}, {result['model_size']} {result['base'] or ''}, "
            f"{result['steps']} steps), "
            "best first",
            ranked,
            cols,
        )
    )
    if result["best"]:
        console.print(
            f"best: [bold]{result['best']['run']}[/] (val loss {result['best']['final_val_loss']:.4f})"
        )
