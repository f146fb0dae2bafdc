"""``analyze scaling``: train several model sizes for the same number of steps, fit the final
validation loss against parameters and against training compute with power laws, and predict a
4B-parameter model with an interval.

Each variant is ``PRESET[:FIELD=VALUE,...]`` and trains through hydra-train's loop
(:mod:`hydra_diag.short_runs`) on the same data, batch and schedule. Compute is the model's own
executed training FLOPs per token (routing included) times the tokens seen. The compute of the
4B model at the same number of tokens is extrapolated from the largest variant's FLOPs per
parameter per token. Defaults: on CUDA the presets debug, 100M and 250M; on a CPU three narrow
``tiny`` variants (the point there is the method, not the numbers).

Caveat printed with the result: a few hundred steps from three sizes fit a line through three
points; the interval says how little that pins down.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hydra_diag.loading import parse_overrides
from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress
from hydra_diag.powerlaw import fit_power_law

GPU_VARIANTS = ("debug", "100M", "250M")
CPU_VARIANTS = ("tiny:dim=32", "tiny:dim=64", "tiny:dim=128")
TARGET_PARAMS = 4e9


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"tiny:dim=64,n_heads=1"`` → ``("tiny", {"dim": 64, "n_heads": 1})``."""
    preset, _, rest = spec.partition(":")
    if not preset:
        raise DiagUsageError(f"variant {spec!r}: expected PRESET[:FIELD=VALUE,...]")
    items = [s for s in rest.split(",") if s.strip()] if rest else []
    return preset.strip(), parse_overrides(items)


def scaling_analysis(
    variants: list[str] | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    lr: float | None = None,
    dataset: str = "synthetic",
    vocab_size: int | None = None,
    device: str = "auto",
    target_params: float = TARGET_PARAMS,
    level: float = 0.9,
    uncertainty: str = "covariance",
    seed: int = 1337,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Train every variant, fit, predict (see the module docstring)."""
    from hydra_diag.short_runs import check_short_run, check_value_types, run_short_training

    cuda = torch.cuda.is_available() and device != "cpu"
    variants = list(variants or (GPU_VARIANTS if cuda else CPU_VARIANTS))
    if len(variants) < 2:
        raise DiagUsageError("a scaling fit needs at least two variants (--variant, repeatable)")
    # checked before any variant trains: the fit would refuse them only after all the training
    if uncertainty not in ("covariance", "bootstrap"):
        raise DiagUsageError(f"--uncertainty {uncertainty!r}: use covariance or bootstrap")
    if not 0.0 < level < 1.0:
        raise DiagUsageError(f"--level {level}: an interval level is a fraction in (0, 1), e.g. 0.9")
    if not target_params > 0:  # a power law has no value at x <= 0 (math.log would raise)
        raise DiagUsageError(f"--target-params {target_params}: a model size is a positive number")
    steps = steps or (60 if cuda else 12)
    batch_size = batch_size or (8 if cuda else 4)
    seq_len = seq_len or (512 if cuda else 32)
    vocab = vocab_size if vocab_size is not None else (32000 if cuda else 512)
    shape = dict(
        steps=steps,
        dataset=dataset,
        vocab_size=vocab,
        seq_len=seq_len,
        batch_size=batch_size,
        device=device,
        seed=seed,
    )
    plan = []
    for spec in variants:  # every variant checked before the first trains
        preset, ov = parse_variant(spec)
        settings = {**ov, **({"lr": lr} if lr is not None else {})}
        check_value_types(ov, f"--variant {spec}:")
        check_short_run(f"--variant {spec}", model_size=preset, settings=settings, **shape)
        plan.append((spec, preset, settings))
    runs = []
    for i, (spec, preset, settings) in enumerate(plan):
        progress(f"variant {i + 1}/{len(variants)}: {spec}")
        t0 = time.perf_counter()
        s = run_short_training(model_size=preset, settings=settings, label=spec, progress=progress, **shape)
        runs.append(
            {
                "variant": spec,
                "params": s["params"],
                "final_val_loss": s.get("final_val_loss"),
                "first_val_loss": s.get("first_val_loss"),
                "tokens_seen": s.get("tokens_seen"),
                "flops_per_token": s["flops_per_token"],
                "train_flops": s["train_flops"],
                "tokens_per_s": s.get("tokens_per_s"),
                "wall_s": time.perf_counter() - t0,
                "skipped_steps": s.get("skipped_steps"),
            }
        )
    # a diverged variant (NaN/inf loss) has no place on the curve; the fit would drop it anyway
    usable = [r for r in runs if r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"])]
    if len(usable) < 2:
        raise DiagError("fewer than two variants produced a finite validation loss; nothing to fit")
    losses = [r["final_val_loss"] for r in usable]
    try:
        by_params = fit_power_law([r["params"] for r in usable], losses, uncertainty)
        by_compute = fit_power_law([r["train_flops"] for r in usable], losses, uncertainty)
    except ValueError as exc:  # e.g. every variant has the same size
        raise DiagError(f"cannot fit the variants ({exc}): give variants of different sizes") from None
    largest = max(usable, key=lambda r: r["params"])
    flops_per_param_token = largest["flops_per_token"] / largest["params"]
    target_compute = flops_per_param_token * target_params * largest["tokens_seen"]
    notes = [
        f"{len(usable)} sizes × {steps} steps: the fit is only as good as its few points (see the interval)",
        "compute of the target assumes the largest variant's FLOPs per parameter per token",
    ]
    if by_params.exponent <= 0:
        notes.append("the loss does not fall with size here: the exponent is ≤ 0 (too few steps or sizes)")
    return {
        "tool": "scaling_analysis",
        "device": "cuda" if cuda else "cpu",
        "dataset": dataset,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "vocab_size": vocab,
        "runs": runs,
        "fit_params": by_params.as_dict(),
        "fit_compute": by_compute.as_dict(),
        "target_params": target_params,
        "target_compute": target_compute,
        "prediction_by_params": by_params.predict(target_params, level),
        "prediction_by_compute": by_compute.predict(target_compute, level),
        "notes": notes,
    }


def render_scaling(result: dict[str, Any], console) -> None:
    from hydra_diag.render import fmt, rows_table

    console.print(
        rows_table(
            f"scaling runs ({result['steps']} steps, batch {result['batch_size']}x{result['seq_len']}, "
            f"{result['dataset']})",
            result["runs"],
            [
                "variant",
                "params",
                "final_val_loss",
                "tokens_seen",
                "flops_per_token",
                "train_flops",
                "tokens_per_s",
            ],
        )
    )
    fp, fc = result["fit_params"], result["fit_compute"]
    rows = [
        {
            "fit": "loss vs params",
            "coefficient": fp["coefficient"],
            "exponent": fp["exponent"],
            "exponent_se": fp["exponent_se"],
            "r2": fp["r2"],
        },
        {
            "fit": "loss vs compute",
            "coefficient": fc["coefficient"],
            "exponent": fc["exponent"],
            "exponent_se": fc["exponent_se"],
            "r2": fc["r2"],
        },
    ]
    console.print(rows_table("power laws L = a·x^(−α) (least squares in log space)", rows))
    for key, label in (("prediction_by_params", "params"), ("prediction_by_compute", "compute")):
        p = result[key]
        console.print(
            f"predicted loss of a {result['target_params'] / 1e9:.3g}B model (by {label}, x={p['x']:.3g}): "
            f"[bold]{p['y']:.4f}[/], {p['level']:.0%} CI {fmt(p['ci'])}, prediction interval {fmt(p['pi'])}",
            highlight=False,
        )
    for n in result["notes"]:
        console.print(f"[dim]note: {n}[/]", highlight=False)
