"""``eval checkpoint`` (validation loss and perplexity of a saved model) and ``eval sanity``
(can this configuration learn at all?).

``eval checkpoint`` reads the run's own validation batches by default (the dataset, sequence
length, batch size and number of batches stored in the checkpoint's TrainConfig, taken the way
hydra-train takes them), so on the same device and precision its loss reproduces the validation
loss the run logged; the report shows both. CUDA (bf16 autocast) when present, else the CPU.

``eval sanity`` runs two short experiments on a fresh model: it overfits one batch (the loss
must fall to a fraction of its start), and it trains through hydra-train's loop on a learnable
stream (the validation loss must fall, and no step may be skipped as non-finite).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hydra_diag.loading import (
    autocast_for,
    batches_for,
    build_model,
    load_model,
    parse_overrides,
    pick_device,
    random_batches,
)
from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress


@torch.no_grad()
def mean_cross_entropy(model, batches, device: torch.device, routing: str = "eval") -> tuple[float, int]:
    """Token-weighted mean CE over ``batches`` (targets −100 ignored), with ``routing`` eval|train."""
    was = model.training
    model.train(routing == "train")
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for x, y in batches:
            with autocast_for(device):
                out = model(x, targets=y)
            n = int((y != -100).sum())
            if n:  # a batch with every target ignored has a NaN mean (0/0): it holds no tokens
                total += out.ce_loss.double() * n
                count += n
    finally:
        model.train(was)
    return float(total / max(count, 1)), count


def eval_checkpoint(
    checkpoint: str,
    dataset: str | None = None,
    tokenizer: str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    n_batches: int | None = None,
    split: str = "val",
    routing: str = "eval",
    device: str = "auto",
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Validation loss, perplexity and bits per token of ``checkpoint`` (see the module docstring)."""
    if routing not in ("eval", "train"):
        raise DiagUsageError(f"--routing {routing!r}: use eval (causal thresholds) or train (top-k)")
    if split not in ("val", "train"):
        raise DiagUsageError(f"--split {split!r}: use val or train")
    if tokenizer is not None:  # refused now, as convert refuses it: shards would never read it
        from hydra_diag.convert import load_tokenizer_file

        load_tokenizer_file(tokenizer)
    dev = pick_device(device)
    progress("loading the checkpoint")
    loaded = load_model(checkpoint, dev)
    model, tc = loaded.model, loaded.train_config
    seq_len = seq_len or tc.get("seq_len") or min(512, model.config.max_seq_len)
    batch_size = batch_size or tc.get("batch_size") or 8
    n_batches = n_batches or tc.get("eval_batches") or 8
    if seq_len > model.config.max_seq_len:  # the forward would raise ValueError mid-evaluation
        raise DiagError(f"--seq_len {seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}")
    if dataset is None and not (tc.get("dataset") and _available(tc["dataset"])):
        where = (
            f"its dataset {tc['dataset']!r} is not available here"
            if tc.get("dataset")
            else "it names no dataset"
        )
        raise DiagError(f"{loaded.source}: {where}; pass --dataset (or --dataset random for random tokens)")
    progress("reading batches")
    batches, data_desc = batches_for(
        model,
        dataset=dataset,
        train_config=tc,
        batch_size=batch_size,
        seq_len=seq_len,
        n=n_batches,
        device=dev,
        split=split,
        tokenizer=tokenizer,
    )
    progress(f"evaluating {len(batches)} batches")
    t0 = time.perf_counter()
    loss, tokens = mean_cross_entropy(model, batches, dev, routing)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    recorded = _recorded_val_loss(loaded.checkpoint_path) if loaded.checkpoint_path else None
    return {
        "tool": "eval_checkpoint",
        "source": loaded.source,
        "step": loaded.step,
        "data": data_desc,
        "split": split,
        "routing": routing,
        "device": str(dev),
        "precision": "bf16 autocast" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32",
        "batches": len(batches),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens": tokens,
        "val_loss": loss,
        "perplexity": math.exp(loss) if loss < 50 else None,
        "bits_per_token": loss / math.log(2),
        "uniform_loss": math.log(model.config.vocab_size),
        "recorded_val_loss": recorded,
        "tokens_per_s": tokens / secs if secs > 0 else None,
    }


def _available(dataset: str) -> bool:
    from pathlib import Path

    from hydra_train.config import EMBEDDED_CORPORA

    return dataset in (*EMBEDDED_CORPORA, "synthetic") or Path(dataset).exists()


def _recorded_val_loss(path) -> float | None:
    """The last validation loss the run logged before saving this checkpoint (trainer state)."""
    from hydra_diag.loading import read_checkpoint

    if path is None or not path.is_file():
        return None
    hist = read_checkpoint(path).get("trainer", {}).get("val_history") or []
    return float(hist[-1][1]) if hist else None


def overfit_single_batch(
    model, batch, steps: int, lr: float, device: torch.device, progress: Progress
) -> list[float]:
    """Train on one batch ``steps`` times with hydra-train's AdamW; the losses before each step."""
    from hydra_train.optim import build_optimizer, clip_and_step

    opt = build_optimizer(model, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), log=lambda m: None).optimizer
    model.train()
    x, y = batch
    losses = []
    for i in range(steps):
        with autocast_for(device):
            out = model(x, targets=y)
        out.loss.backward()
        clip_and_step(opt, [p for p in model.parameters() if p.requires_grad], 1.0)
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.ce_loss.detach()))
        if i % 10 == 0:
            progress(f"overfit step {i}/{steps}, loss {losses[-1]:.3f}")
    return losses


def eval_sanity(
    model_size: str = "tiny",
    overrides: list[str] | dict[str, Any] | None = None,
    device: str = "auto",
    batch_size: int = 4,
    seq_len: int = 64,
    overfit_steps: int = 60,
    overfit_lr: float = 3e-3,
    overfit_ratio: float = 0.5,
    run_steps: int = 30,
    run_lr: float = 3e-3,
    min_drop: float = 0.05,
    dataset: str = "synthetic",
    seed: int = 0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """The two short experiments of the module docstring; ``passed`` only when every check holds."""
    from hydra_diag.short_runs import run_short_training

    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    dev = pick_device(device)
    torch.manual_seed(seed)
    progress("building the model")
    model = build_model(model_size, ov, dev)
    seq_len = min(seq_len, model.config.max_seq_len)
    batch = random_batches(model.config.vocab_size, batch_size, seq_len, 1, seed, dev)[0]
    losses = overfit_single_batch(model, batch, overfit_steps, overfit_lr, dev, progress)
    checks = []
    finite = all(math.isfinite(v) for v in losses)
    first, last = losses[0], min(losses[-3:])
    checks.append(
        {
            "name": "overfit one batch",
            "passed": finite and last <= overfit_ratio * first,
            "value": f"{first:.3f} -> {last:.3f}",
            "expected": f"<= {overfit_ratio:.0%} of the start after {overfit_steps} steps",
            "detail": f"lr {overfit_lr}, batch {batch_size}x{seq_len} random tokens",
        }
    )
    del model
    vocab = int(ov.get("vocab_size", 512))
    settings = {k: v for k, v in ov.items() if k != "vocab_size"}
    summary = run_short_training(
        model_size=model_size,
        steps=run_steps,
        settings={**settings, "lr": run_lr},
        dataset=dataset,
        vocab_size=vocab,
        seq_len=seq_len,
        batch_size=batch_size,
        device=device,
        seed=seed + 1,
        label="short run",
        progress=progress,
    )
    v0, v1 = summary.get("first_val_loss"), summary.get("final_val_loss")
    dropped = v0 is not None and v1 is not None and v1 <= (1 - min_drop) * v0
    checks.append(
        {
            "name": "validation loss decreases",
            "passed": bool(dropped),
            "value": f"{v0:.3f} -> {v1:.3f}" if v0 is not None and v1 is not None else None,
            "expected": f"final <= {1 - min_drop:.0%} of first",
            "detail": f"{run_steps} steps of hydra-train on {summary.get('data')}",
        }
    )
    checks.append(
        {
            "name": "no non-finite steps",
            "passed": summary.get("skipped_steps") == 0,
            "value": summary.get("skipped_steps"),
            "expected": 0,
            "detail": "steps hydra-train skipped because a gradient or the loss was not finite",
        }
    )
    return {
        "tool": "eval_sanity_diagnostic",
        "model_size": model_size,
        "overrides": ov,
        "device": str(dev),
        "overfit_losses": losses,
        "run": {
            k: summary.get(k)
            for k in (
                "first_val_loss",
                "final_val_loss",
                "steps",
                "tokens_per_s",
                "skipped_steps",
                "params",
                "data",
            )
        },
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }


def render_eval_checkpoint(result: dict[str, Any], console) -> None:
    from hydra_diag.render import kv_table

    keys = (
        "source",
        "data",
        "split",
        "routing",
        "device",
        "precision",
        "batches",
        "tokens",
        "val_loss",
        "perplexity",
        "bits_per_token",
        "uniform_loss",
        "recorded_val_loss",
        "tokens_per_s",
    )
    console.print(kv_table("eval checkpoint", {k: result.get(k) for k in keys}))


def render_eval_sanity(result: dict[str, Any], console) -> None:
    from hydra_diag.render import print_checks

    print_checks(console, f"eval sanity ({result['model_size']}, {result['device']})", result["checks"])
    console.print("[green]sane[/]" if result["passed"] else "[red]not sane[/]")
