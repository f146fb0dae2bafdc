"""``profile kernels`` and ``profile python-overhead``: where a training step's time goes (CUDA).

**kernels**: ``torch.profiler`` over a few training steps (after warm-up) of a preset; the table
lists the GPU kernels by their own device time (name, calls, total and per call, share of all
kernel time), a coarse breakdown by family (GEMM, attention, hydra's Triton kernels, other Triton,
elementwise/reduction, copies, other), and a Chrome trace is written (open it in
``chrome://tracing`` or Perfetto).

**python-overhead**: per training step, in eager mode (and compiled with ``modes``):

* wall time per step (synchronised, median);
* GPU busy time per step: the sum of kernel durations from the profiler;
* host time to *issue* a step: from the step's start (GPU idle, queue empty) to the return of the
  Python call, without waiting for the GPU;
* kernel launches per step.

``idle = 1 − busy / wall`` is the share of the step the GPU waits; when the host needs longer to
issue a step than the GPU needs to run it, the step is CPU (Python/launch) bound.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hydra_diag.harness import StepHarness, free_cuda
from hydra_diag.loading import build_model, parse_overrides, require_cuda_device
from hydra_diag.output import Progress, no_progress

FAMILIES = (
    ("hydra triton", ("_rms_norm", "_swiglu", "_qk_norm", "_rope", "_linear_ce", "_dw_", "hydra")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "cutlass", "xmma", "matmul", "sm90_", "sm80_", "cublas", "wgmma", "_mm_")),
    ("triton (other)", ("triton_",)),
    ("elementwise/reduce", ("elementwise", "reduce", "vectorized", "unrolled", "softmax", "norm")),
    ("copy/index", ("copy", "index", "gather", "scatter", "cat", "memcpy", "memset", "fill")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def _device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _kernel_rows(prof, steps: int) -> tuple[list[dict[str, Any]], float]:
    """Kernel rows (device self time > 0) and the total kernel time per step (ms)."""
    rows, total = [], 0.0
    for evt in prof.key_averages():
        us = _device_time_us(evt)
        if us <= 0:
            continue
        dev_type = str(getattr(evt, "device_type", ""))
        if "CPU" in dev_type and "CUDA" not in dev_type:  # CPU ops that own kernels repeat their time
            continue
        total += us
        rows.append(
            {
                "kernel": evt.key,
                "calls": int(evt.count),
                "total_ms": us / 1000,
                "per_call_us": us / max(evt.count, 1),
                "family": kernel_family(evt.key),
            }
        )
    rows.sort(key=lambda r: -r["total_ms"])
    for r in rows:
        r["share"] = r["total_ms"] * 1000 / total if total else None
        r["per_step_ms"] = r["total_ms"] / steps
    return rows, total / 1000 / steps


def _harness(model_size, overrides, batch_size, seq_len, dev, compile_scope=None) -> StepHarness:
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    torch.manual_seed(0)
    model = build_model(model_size, {"use_chunked_ce": True, "max_seq_len": max(seq_len, 64), **ov}, dev)
    return StepHarness.build(model, batch_size, seq_len, dev, compile_scope=compile_scope)


def profile_kernels(
    model_size: str = "100M",
    overrides: list[str] | dict[str, Any] | None = None,
    batch_size: int = 8,
    seq_len: int = 2048,
    warmup: int = 3,
    steps: int = 3,
    top: int = 25,
    trace: str | None = "profile_kernels_trace.json",
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Top kernels of ``steps`` training steps by device time, families, and a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device) if device else require_cuda_device("profile kernels")
    progress("building the model")
    h = _harness(model_size, overrides, batch_size, seq_len, dev)
    progress("warm-up")
    for _ in range(warmup):
        h.step()
    h.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    progress(f"profiling {steps} steps")
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=False) as prof:
        for _ in range(steps):
            h.step()
        h.sync()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    rows, busy_ms = _kernel_rows(prof, steps)
    trace_path = None
    if trace:
        trace_path = Path(trace)
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    families: dict[str, float] = {}
    for r in rows:
        families[r["family"]] = families.get(r["family"], 0.0) + r["per_step_ms"]
    fam_rows = [
        {"family": k, "per_step_ms": v, "share": v / busy_ms if busy_ms else None}
        for k, v in sorted(families.items(), key=lambda kv: -kv[1])
    ]
    launches = sum(r["calls"] for r in rows) / steps
    h = None
    free_cuda()
    return {
        "tool": "profile_kernels",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "model_size": model_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": busy_ms,
        "launches_per_step": launches,
        "top_kernels": rows[:top],
        "kernels_total": len(rows),
        "families": fam_rows,
        "trace": str(trace_path) if trace_path else None,
    }


def python_overhead(
    model_size: str = "100M",
    overrides: list[str] | dict[str, Any] | None = None,
    batch_size: int = 8,
    seq_len: int = 2048,
    modes: tuple[str, ...] = ("eager",),
    compile_scope: str = "blocks",
    warmup: int = 3,
    steps: int = 5,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """CPU time to issue a step against GPU time to run it, per mode (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device) if device else require_cuda_device("profile python-overhead")
    cuda = dev.type == "cuda"
    rows = []
    for mode in modes:
        progress(f"{mode}: building")
        h = _harness(
            model_size, overrides, batch_size, seq_len, dev, compile_scope if mode == "compile" else None
        )
        for _ in range(warmup):
            h.step()
        h.sync()
        host, wall = [], []
        for _ in range(steps):
            h.sync()
            t0 = time.perf_counter()
            h.step()
            t1 = time.perf_counter()
            h.sync()
            host.append((t1 - t0) * 1000)
            wall.append((time.perf_counter() - t0) * 1000)
        progress(f"{mode}: profiling")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                h.step()
            h.sync()
        krows, busy = _kernel_rows(prof, steps)
        w = statistics.median(wall)
        launches = sum(r["calls"] for r in krows) / steps
        host_ms = statistics.median(host)
        rows.append(
            {
                "mode": mode,
                "wall_ms": w,
                "gpu_busy_ms": busy if cuda else None,
                "host_issue_ms": host_ms,
                "gpu_idle_share": (1 - busy / w) if cuda and w else None,
                "launches_per_step": launches,
                "host_us_per_launch": host_ms * 1000 / launches if launches else None,
                "bound": ("cpu" if host_ms >= busy else "gpu") if cuda else None,
                "tokens_per_s": h.tokens_per_step / (w / 1000),
            }
        )
        h = None
        free_cuda()
    return {
        "tool": "profile_python_overhead",
        "device": torch.cuda.get_device_name(dev) if cuda else str(dev),
        "model_size": model_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "rows": rows,
    }


def render_profile_kernels(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"top kernels: {result['model_size']} B={result['batch_size']} T={result['seq_len']} "
            f"on {result['device']} "
            f"({result['kernel_ms_per_step']:.1f} ms of kernels per "
            f"{result['wall_ms_per_step']:.1f} ms step, "
            f"{result['launches_per_step']:.0f} launches/step)",
            [{**r, "kernel": r["kernel"][:80]} for r in result["top_kernels"]],
            ["kernel", "family", "calls", "per_step_ms", "per_call_us", "share"],
            formats={"share": ".1%"},
        )
    )
    console.print(rows_table("kernel time by family", result["families"], formats={"share": ".1%"}))
    if result.get("trace"):
        console.print(f"Chrome trace: {result['trace']}", highlight=False)


def render_python_overhead(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"CPU vs GPU time per training step: {result['model_size']} "
            f"B={result['batch_size']} T={result['seq_len']} "
            f"on {result['device']}",
            result["rows"],
            [
                "mode",
                "wall_ms",
                "gpu_busy_ms",
                "host_issue_ms",
                "gpu_idle_share",
                "launches_per_step",
                "host_us_per_launch",
                "bound",
                "tokens_per_s",
            ],
            formats={"gpu_idle_share": ".1%", "tokens_per_s": ",.0f"},
        )
    )
