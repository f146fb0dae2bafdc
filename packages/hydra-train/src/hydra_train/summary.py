"""The run summary: what ``hydra-train run`` prints at the end (a table, or JSON with ``--json``)
and what the run's callbacks receive in ``on_train_end``.

A number that is not finite (the loss of a skipped last step, the best loss of a run that logged
none) is ``None`` in the summary, as it is NULL in training.db: the summary is written as JSON
(``--json``, ``--summary_dir``), which has no NaN or Infinity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hydra_kernels.cli_support import finite_json


def describe_run(summary: dict[str, Any], run: Any) -> dict[str, Any]:
    """Add to the trainer's ``summary`` what the run was (model, device, data, where things went)."""
    cfg, model, device = run.cfg, run.model, run.device
    summary.update(
        arch=cfg.model.arch,
        model_size=cfg.model.model_size,
        params=run.n_params,
        device=str(device),
        precision=cfg.runtime.precision,
        world_size=run.dist.world_size,
        checkpoint_dir=str(run.ckpt_dir),
        run_dir=str(run.artifacts.folder),
        database=str(run.database),
        optimizer=run.optimizer_choice.name,
        optimizer_note=run.optimizer_choice.note,
        batch_size=cfg.data.batch_size,
        seq_len=cfg.data.seq_len,
        grad_accum=cfg.optim.grad_accum,
        data=run.data.description,
        resumed_from=run.resumed_from,
        compile=cfg.optimizations.compile,
        triton_kernels=cfg.optimizations.triton_kernels,
        chunked_ce=cfg.model.chunked_ce,
        fsdp=cfg.runtime.fsdp,
        ddp_grad_sync=cfg.runtime.ddp_grad_sync,
        grad_sync=_grad_sync(run),
    )
    if hasattr(model, "flops_per_token") and summary.get("tokens_per_s"):
        fpt = float(model.flops_per_token(cfg.data.seq_len, executed=True))
        summary["tflops_per_s"] = summary["tokens_per_s"] * fpt / 1e12
    if device.type == "cuda":
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    for key, value in summary.items():  # JSON has no NaN/Infinity: null, as the database's NULL
        summary[key] = finite_json(value)
    return summary


def write_summary_json(summary: dict[str, Any], path: Path) -> None:
    """``--summary_dir``'s file: the summary as JSON (its folder made; written atomically)."""
    import json

    from hydra_train.atomic_files import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(summary, indent=2).encode("utf-8"))


def _grad_sync(run: Any) -> str | None:
    """Who averaged the gradients over ranks when the run ended (None: one process)."""
    if run.dist.world_size <= 1:
        return None
    if run.cfg.runtime.fsdp:
        return "fsdp2"
    return "allreduce" if getattr(run.trainer, "grad_averager", None) is not None else "ddp_reducer"


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (label, value) rows for the table the CLI prints."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    rows = [
        ("status", s.get("status", "-")),
        (
            "model",
            f"{s.get('arch', 'hydra')} {s.get('model_size')} ({f(s.get('params', 0) / 1e6, '.2f')}M params), "
            f"{s.get('device')}, "
            f"{s.get('precision')}, world size {s.get('world_size')}"
            + (f" (gradients: {s['grad_sync']})" if s.get("grad_sync") else ""),
        ),
        ("data", str(s.get("data"))),
        (
            "steps",
            f"{s.get('steps')} ({f(s.get('tokens_seen'), ',d')} tokens, batch {s.get('batch_size')} x "
            f"{s.get('seq_len')} x accum {s.get('grad_accum')}), skipped {s.get('skipped_steps')}",
        ),
        (
            "validation loss",
            f"{f(s.get('first_val_loss'), '.4f')} -> {f(s.get('final_val_loss'), '.4f')} "
            f"(best {f(s.get('best_val_loss'), '.4f')})",
        ),
        ("train loss (last)", f(s.get("final_loss"), ".4f")),
        (
            "tokens/s",
            f"{f(s.get('tokens_per_s'), ',.0f')} "
            f"(mean over training time {f(s.get('train_time_s'), '.1f')} s;"
            f" last interval {f(s.get('tokens_per_s_last'), ',.0f')})",
        ),
    ]
    if s.get("tflops_per_s") is not None:
        rows.append(("model TFLOP/s", f"{s['tflops_per_s']:.2f} (executed FLOPs)"))
    if s.get("peak_memory_gib") is not None:
        rows.append(("peak memory", f"{s['peak_memory_gib']:.2f} GiB allocated"))
    else:
        rows.append(("peak memory", f"{f(s.get('memory_mb'), ',.0f')} MiB resident (process)"))
    rows.append(
        (
            "optimizer",
            s.get("optimizer", "-") + (f" ({s['optimizer_note']})" if s.get("optimizer_note") else ""),
        )
    )
    if s.get("safe_opts"):
        on = [n for n, st in s["safe_opts"].items() if st in ("ENABLED", "STABLE")]
        off = [f"{n} {st}" for n, st in s["safe_opts"].items() if st not in ("ENABLED", "STABLE", "OFF")]
        rows.append(("optimizations", f"on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"))
    if s.get("logger_errors"):
        rows.append(("loggers", "; ".join(f"{n} {why}" for n, why in s["logger_errors"].items())))
    rows += [
        ("checkpoint", str(s.get("final_checkpoint", "-"))),
        ("metrics database", str(s.get("database"))),
        ("run artifacts", str(s.get("run_dir"))),
    ]
    return rows
