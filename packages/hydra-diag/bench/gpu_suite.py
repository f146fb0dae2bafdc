"""Every GPU command of hydra-diag, once, on one CUDA GPU, in one process (about 4–5 minutes on an H100).

    source tools/gpu_env.sh; python packages/hydra-diag/bench/gpu_suite.py --out "$OUT"
    python packages/hydra-diag/bench/gpu_suite.py --out "$OUT" --only bench_kernels,bench_model

Each step is a real ``hydra-diag`` command line (parsed and run by the app itself, in-process so
torch and the kernels load once) with ``--json``; its JSON goes to ``OUT/json/<step>.json`` and its
PNG to ``OUT/<step>.png``. At the end the tables of every result are printed again (from the JSON)
and everything that is not a PNG is packed into ``OUT/hydra_diag_gpu_suite.tar.gz`` (JSON, the
Chrome trace, ``suite_summary.json`` with each step's exit status and wall time), so that at most
eight files come back from the device.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tarfile
import time
import traceback
from pathlib import Path

#: (step name, hydra-diag arguments without --json / --plot). Sizes chosen for the time budget.
STEPS: list[tuple[str, list[str]]] = [
    ("bench_kernels", ["bench", "kernels", "--no-compile", "--rep", "30"]),
    ("bench_backward_kernels", ["bench", "backward-kernels", "--no-compile", "--rep", "30"]),
    ("bench_swiglu_backward", ["bench", "swiglu-backward", "--rep", "25"]),
    ("bench_tall_skinny", ["bench", "tall-skinny", "--rep", "25"]),
    (
        "bench_model",
        [
            "bench",
            "model",
            "--model_size",
            "100M",
            "--config",
            "dynamic",
            "--config",
            "dense",
            "--steps",
            "8",
        ],
    ),
    ("bench_performance", ["bench", "performance", "--model_size", "100M", "--steps", "5", "--rep", "30"]),
    (
        "sweep_throughput",
        [
            "sweep",
            "throughput",
            "--model_size",
            "100M",
            "--batch_size",
            "4",
            "--batch_size",
            "8",
            "--batch_size",
            "16",
            "--seq_len",
            "1024",
            "--seq_len",
            "2048",
            "--steps",
            "3",
        ],
    ),
    (
        "sweep_vram",
        [
            "sweep",
            "vram",
            "--model_size",
            "100M",
            "--batch_size",
            "8",
            "--start_seq",
            "2048",
            "--max_seq",
            "32768",
            "--refine_steps",
            "2",
        ],
    ),
    ("profile_kernels", ["profile", "kernels", "--model_size", "100M", "--steps", "2"]),
    ("profile_python_overhead", ["profile", "python-overhead", "--model_size", "100M", "--steps", "5"]),
    (
        "analyze_scaling",
        [
            "analyze",
            "scaling",
            "--variant",
            "tiny",
            "--variant",
            "debug",
            "--variant",
            "100M",
            "--steps",
            "40",
            "--seq_len",
            "512",
            "--batch_size",
            "8",
        ],
    ),
]
WITH_PLOT = {
    "bench_swiglu_backward",
    "bench_tall_skinny",
    "sweep_throughput",
    "sweep_vram",
    "profile_kernels",
    "analyze_scaling",
}


def run_step(name: str, args: list[str], out: Path) -> dict:
    """Run one command in-process; its stdout (the JSON) is captured, its stderr (progress) streams."""
    import typer.main

    from hydra_diag.cli import app

    argv = [*args, "--json"]
    if name in WITH_PLOT:
        argv += ["--plot", str(out / f"{name}.png")]
    if name == "profile_kernels":
        argv += ["--trace", str(out / "trace" / "profile_kernels_trace.json")]
    print(f"\n=== {name}: hydra-diag {' '.join(argv)}", file=sys.stderr, flush=True)
    buf = io.StringIO()
    t0 = time.perf_counter()
    rc, err = 0, None
    try:
        with contextlib.redirect_stdout(buf):
            rc = (
                typer.main.get_command(app).main(args=argv, prog_name="hydra-diag", standalone_mode=False)
                or 0
            )
    except SystemExit as exc:
        rc = int(exc.code or 0)
    except Exception as exc:  # the suite goes on; the step is reported as failed
        rc, err = 1, f"{type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()
    wall = time.perf_counter() - t0
    text = buf.getvalue()
    (out / "json" / f"{name}.json").write_text(text)
    print(f"=== {name}: exit {rc} in {wall:.1f}s", file=sys.stderr, flush=True)
    return {"step": name, "command": "hydra-diag " + " ".join(argv), "exit": rc, "wall_s": wall, "error": err}


def print_tables(out: Path, steps: list[dict]) -> None:
    """Re-render each step's tables from its JSON (the renderers the commands themselves use)."""
    from rich.console import Console

    from hydra_diag.kernel_bench import render_kernel_rows
    from hydra_diag.matmul_bench import render_tall_skinny
    from hydra_diag.model_bench import render_bench_model, render_throughput, render_vram
    from hydra_diag.perf_suite import render_performance
    from hydra_diag.profiling import render_profile_kernels, render_python_overhead
    from hydra_diag.scaling import render_scaling

    renderers = {
        "bench_kernels": render_kernel_rows,
        "bench_backward_kernels": render_kernel_rows,
        "bench_swiglu_backward": render_kernel_rows,
        "bench_tall_skinny": render_tall_skinny,
        "bench_model": render_bench_model,
        "bench_performance": render_performance,
        "sweep_throughput": render_throughput,
        "sweep_vram": render_vram,
        "profile_kernels": render_profile_kernels,
        "profile_python_overhead": render_python_overhead,
        "analyze_scaling": render_scaling,
    }
    console = Console(width=170)
    for s in steps:
        path = out / "json" / f"{s['step']}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            console.print(f"[red]{s['step']}: no JSON result (exit {s['exit']}: {s['error']})[/]")
            continue
        console.rule(f"{s['step']} ({s['wall_s']:.0f}s)")
        if (
            s["step"] == "bench_swiglu_backward"
        ):  # the full grid is in the JSON; show the bf16 16384-row slice
            data = {**data, "rows": [r for r in data["rows"] if r.get("tokens") == 16384]}
        renderers[s["step"]](data, console)


def pack(out: Path, summary: dict) -> None:
    """``OUT/hydra_diag_gpu_suite.tar.gz``: every JSON result, the trace and the suite summary."""
    (out / "json" / "suite_summary.json").write_text(json.dumps(summary, indent=2))
    tmp = out / "hydra_diag_gpu_suite.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in ("json", "trace"):
            tar.add(out / sub, arcname=sub)
    tmp.replace(out / "hydra_diag_gpu_suite.tar.gz")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_suite_out"))
    p.add_argument("--only", default="", help="comma list of step names (default: all)")
    p.add_argument("--time-budget", type=float, default=330.0, help="seconds after which no new step starts")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    out = Path(args.out)
    for sub in ("json", "trace"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    chosen = [s for s in STEPS if not args.only or s[0] in args.only.split(",")]
    import triton

    t0 = time.perf_counter()
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "total_s": 0.0,
        "steps": [],
    }
    for name, cmd in chosen:
        if time.perf_counter() - t0 > args.time_budget:
            summary["steps"].append(
                {"step": name, "exit": None, "wall_s": 0.0, "error": "skipped: time budget"}
            )
            continue
        summary["steps"].append(run_step(name, cmd, out))
        summary["total_s"] = time.perf_counter() - t0
        pack(out, summary)  # after every step, so a run cut short still brings back what finished
    results = [r for r in summary["steps"] if r["exit"] is not None]
    print_tables(out, results)
    pack(out, summary)
    for sub in ("json", "trace"):
        shutil.rmtree(out / sub)
    print(
        f"\n{summary['device']}, torch {summary['torch']}, triton {summary['triton']}: "
        f"{len(results)} steps in {summary['total_s']:.0f}s"
    )
    for r in summary["steps"]:
        print(f"  {r['step']:<26} exit {r['exit']}  {r['wall_s']:6.1f}s  {r['error'] or ''}")
    return 0 if all(r["exit"] == 0 for r in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
