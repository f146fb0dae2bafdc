"""Model-level GPU measurements: ``bench model`` (training-step throughput, MFU, memory),
``sweep throughput`` (batch × sequence length) and ``sweep vram`` (peak memory against sequence
length and the longest one that fits).

MFU counts the FLOPs the model actually executes (``model.flops_per_token(T, executed=True)``:
tokens skipped by MoD and recursions not reached are not counted) against the device's dense
bf16 peak. Memory: ``peak_gib`` is the most the caching allocator held over the timed steps,
with ``graph_pool_gib`` and ``peak_allocated_gib`` beside it (hydra_diag/device_memory.py says what
each counts; results written before it have the allocated peak as ``peak_gib``). Each library
function takes ``device``; the default is the current CUDA device (a :class:`DiagError` without
one). Passing ``"cpu"`` runs the same code slowly, for tests only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hydra_diag.device_memory import MEMORY_FIELDS
from hydra_diag.harness import StepHarness, free_cuda, is_oom, peak_flops
from hydra_diag.loading import build_model, parse_overrides, require_cuda_device
from hydra_diag.output import DiagError, Progress, no_progress

MODEL_CONFIGS = {"dynamic": {}, "static": {"static_routing_mode": True}, "dense": {"routing_off": True}}


def _device(device: str | None, tool: str) -> torch.device:
    return torch.device(device) if device else require_cuda_device(tool)


def _env(dev: torch.device) -> dict[str, Any]:
    import triton

    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def bench_model(
    model_size: str = "100M",
    configs: tuple[str, ...] = ("dynamic", "static", "dense"),
    modes: tuple[str, ...] = ("eager",),
    batch_size: int = 8,
    seq_len: int = 2048,
    steps: int = 10,
    warmup: int = 3,
    chunked_ce: bool = True,
    checkpoint_every: int = 0,
    compile_scope: str = "blocks",
    overrides: list[str] | dict[str, Any] | None = None,
    peak_tflops: float | None = None,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """tokens/s, MFU on executed FLOPs and peak memory per (config, mode)."""
    dev = _device(device, "bench model")
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    peak, peak_src = peak_flops(dev, peak_tflops) if dev.type == "cuda" else (None, "cpu")
    rows = []
    for mode in modes:
        for name in configs:
            if name not in MODEL_CONFIGS:
                raise DiagError(f"unknown config {name!r}; choose from {', '.join(MODEL_CONFIGS)}")
            progress(f"{model_size} {name} {mode}")
            row: dict[str, Any] = {"config": name, "mode": mode}
            try:
                torch.manual_seed(0)
                cfg = {
                    **MODEL_CONFIGS[name],
                    "use_chunked_ce": chunked_ce,
                    "max_seq_len": max(seq_len, 64),
                    **ov,
                }
                model = build_model(model_size, cfg, dev)
                if checkpoint_every:
                    model.enable_gradient_checkpointing(every=checkpoint_every)
                t0 = time.perf_counter()
                h = StepHarness.build(
                    model,
                    batch_size,
                    seq_len,
                    dev,
                    compile_scope=compile_scope if mode == "compile" else None,
                )
                for _ in range(warmup):
                    h.step()
                h.sync()
                row["warmup_s"] = time.perf_counter() - t0
                row.update(h.timed_steps(steps))
                fpt = model.flops_per_token(seq_len, executed=True)
                row.update(
                    params=model.num_parameters(),
                    flops_per_token_executed=fpt,
                    flops_per_token_dense=model.flops_per_token(seq_len, executed=False),
                    tflops=row["tokens_per_s"] * fpt / 1e12,
                    mfu=row["tokens_per_s"] * fpt / peak if peak else None,
                )
            except Exception as exc:  # an OOM or a failing mode is a result, the next one still runs
                row["error"] = (
                    "out of memory: " if is_oom(exc) else ""
                ) + f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                model = h = None
                free_cuda()
            rows.append(row)
    import hydra_kernels
    from hydra_model import attention_fallback_counts, moe_dispatch_counts

    return {
        "tool": "benchmark_hydra_models",
        **(_env(dev)),
        "model_size": model_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "chunked_ce": chunked_ce,
        "peak_flops": peak,
        "peak_source": peak_src,
        "rows": rows,
        "kernel_fallbacks": hydra_kernels.fallback_counts(),
        "attention_fallbacks": attention_fallback_counts(),
        "moe_dispatch": moe_dispatch_counts(),
    }


def throughput_sweep(
    model_size: str = "100M",
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096),
    steps: int = 5,
    warmup: int = 2,
    overrides: list[str] | dict[str, Any] | None = None,
    peak_tflops: float | None = None,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """tokens/s and peak memory for every batch × sequence length (OOM cells are marked)."""
    dev = _device(device, "sweep throughput")
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    peak, peak_src = peak_flops(dev, peak_tflops) if dev.type == "cuda" else (None, "cpu")
    torch.manual_seed(0)
    model = build_model(model_size, {"use_chunked_ce": True, "max_seq_len": max(seq_lens), **ov}, dev)
    cells = []
    for s in seq_lens:
        fpt = model.flops_per_token(s, executed=True)
        oom_at = None
        for b in batch_sizes:
            progress(f"batch {b} × seq {s}")
            cell: dict[str, Any] = {"batch_size": b, "seq_len": s}
            if oom_at is not None and b > oom_at:  # larger batches of the same length cannot fit either
                cell["error"] = f"skipped: batch {oom_at} already ran out of memory"
                cells.append(cell)
                continue
            h = None
            try:
                h = StepHarness.build(model, b, s, dev)
                for _ in range(warmup):
                    h.step()
                cell.update(h.timed_steps(steps))
                cell["tflops"] = cell["tokens_per_s"] * fpt / 1e12
                cell["mfu"] = cell["tokens_per_s"] * fpt / peak if peak else None
            except Exception as exc:
                if not is_oom(exc):
                    raise
                cell["error"] = "out of memory"
                oom_at = b
            finally:
                if h is not None:
                    h.optimizer.zero_grad(set_to_none=True)
                h = None
                free_cuda()
            cells.append(cell)
    ok = [c for c in cells if "tokens_per_s" in c]
    best = max(ok, key=lambda c: c["tokens_per_s"]) if ok else None
    return {
        "tool": "throughput_sweep",
        **_env(dev),
        "model_size": model_size,
        "params": model.num_parameters(),
        "peak_source": peak_src,
        "cells": cells,
        "best": best,
    }


def vram_sweep(
    model_size: str = "100M",
    batch_size: int = 8,
    start_seq: int = 1024,
    max_seq: int = 32768,
    refine_steps: int = 3,
    multiple: int = 256,
    overrides: list[str] | dict[str, Any] | None = None,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Peak training memory against sequence length: doubling from ``start_seq`` until a step runs
    out of memory (or ``max_seq``), then bisecting (``refine_steps`` times, to a ``multiple``) for the
    longest that fits. The analytic estimate (``compute_memory_footprint``) is reported beside it."""
    from hydra_model import compute_memory_footprint

    dev = _device(device, "sweep vram")
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    torch.manual_seed(0)
    model = build_model(model_size, {"use_chunked_ce": True, "max_seq_len": max_seq, **ov}, dev)
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else None
    points: dict[int, dict[str, Any]] = {}

    def probe(s: int) -> bool:
        progress(f"seq {s}")
        est = compute_memory_footprint(model, batch_size, s)["estimated_training_mb"] / 1024
        row: dict[str, Any] = {"seq_len": s, "estimated_gib": est}
        h = None
        try:
            h = StepHarness.build(model, batch_size, s, dev, n_batches=1)
            h.step()  # the optimizer states appear at the first step
            r = h.timed_steps(1)
            row.update(fits=True, step_ms=r["step_ms"], **{k: r[k] for k in MEMORY_FIELDS})
        except Exception as exc:
            if not is_oom(exc):
                raise
            row.update(fits=False, **dict.fromkeys(MEMORY_FIELDS))
        finally:
            if h is not None:
                h.optimizer.zero_grad(set_to_none=True)
            h = None
            free_cuda()
        points[s] = row
        return row["fits"]

    s, last_fit, first_oom = start_seq, None, None
    while s <= max_seq:
        if probe(s):
            last_fit = s
            s *= 2
        else:
            first_oom = s
            break
    if last_fit is not None and first_oom is not None:
        lo, hi = last_fit, first_oom
        for _ in range(refine_steps):
            mid = (lo + hi) // 2 // multiple * multiple
            if mid <= lo or mid >= hi:
                break
            if probe(mid):
                lo = mid
            else:
                hi = mid
        last_fit = lo
    rows = [points[k] for k in sorted(points)]
    return {
        "tool": "seq_len_vram_sweep",
        **_env(dev),
        "model_size": model_size,
        "batch_size": batch_size,
        "params": model.num_parameters(),
        "device_total_gib": total,
        "points": rows,
        "longest_fitting_seq_len": last_fit,
        "first_oom_seq_len": first_oom,
        "capped": first_oom is None,
        "max_seq": max_seq,
    }


def render_bench_model(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"{result['model_size']} training step on {result['device']} "
            f"(B={result['batch_size']} T={result['seq_len']}, "
            f"bf16 autocast, fused AdamW, chunked CE {result['chunked_ce']}); MFU vs {result['peak_source']}",
            result["rows"],
            [
                "config",
                "mode",
                "params",
                "tokens_per_s",
                "step_ms",
                "peak_gib",
                "flops_per_token_executed",
                "tflops",
                "mfu",
                "warmup_s",
                "error",
            ],
            formats={"mfu": ".1%", "tokens_per_s": ",.0f"},
        )
    )
    fb = {k: v for k, v in result["kernel_fallbacks"].items() if v}
    console.print(
        f"kernel fallbacks: {fb or 'none'}; attention fallbacks: {result['attention_fallbacks'] or 'none'}; "
        f"MoE dispatch: {result['moe_dispatch'] or '-'}",
        highlight=False,
    )


def render_throughput(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"throughput sweep: {result['model_size']} on {result['device']}",
            result["cells"],
            ["batch_size", "seq_len", "tokens_per_s", "step_ms", "peak_gib", "tflops", "mfu", "error"],
            formats={"mfu": ".1%", "tokens_per_s": ",.0f"},
        )
    )
    if result["best"]:
        b = result["best"]
        console.print(f"best: batch {b['batch_size']} × {b['seq_len']}: {b['tokens_per_s']:,.0f} tokens/s")


def render_vram(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"peak memory vs sequence length: {result['model_size']}, batch {result['batch_size']}, "
            f"{result['device']} ({result['device_total_gib']} GiB)",
            result["points"],
            # the estimate counts tensors: the allocated peak is its like
            ["seq_len", "fits", "peak_gib", "peak_allocated_gib", "estimated_gib", "step_ms"],
        )
    )
    cap = " (the cap: nothing larger was tried)" if result["capped"] else ""
    longest = result["longest_fitting_seq_len"]
    console.print(
        f"longest sequence that fits: [bold]{longest}[/]{cap}"
        if longest
        else f"[red]even {result['points'][0]['seq_len']} tokens do not fit[/]"
    )
