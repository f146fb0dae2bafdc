"""``hydra-diag sweep``: throughput and memory sweeps (CUDA), hyperparameter sweeps (any device)."""

from typing import Annotated

from hydra_diag.cliutil import (
    Device,
    JsonOut,
    ModelSize,
    NoPlot,
    Overrides,
    PlotPath,
    Seed,
    default_plot,
    execute,
    opt,
)
from hydra_kernels.cli_support import new_app, require_cuda

app = new_app("Sweeps: batch × sequence throughput, memory vs sequence length, training knobs.")


@app.command("throughput")
def throughput_cmd(
    model_size: ModelSize = "100M",
    batch_sizes: Annotated[list[int] | None, opt("--batch_size", help="Batch sizes (repeatable).")] = None,
    seq_lens: Annotated[list[int] | None, opt("--seq_len", help="Sequence lengths (repeatable).")] = None,
    steps: Annotated[int, opt("--steps", help="Timed steps per cell.", min=1)] = 5,
    overrides: Overrides = None,
    peak_tflops: Annotated[float | None, opt("--peak_tflops", help="Device peak for MFU.")] = None,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Training-step tokens/s, MFU and peak memory for every batch size × sequence length (default
    1–16 × 512–4096); cells that run out of memory are marked and larger batches of that length
    skipped. Needs CUDA. PNG: tokens/s and memory against batch size per length."""
    require_cuda("hydra-diag sweep throughput")
    from hydra_diag.model_bench import render_throughput, throughput_sweep
    from hydra_diag.plots_gpu import plot_throughput

    kw = {}
    if batch_sizes:
        kw["batch_sizes"] = tuple(batch_sizes)
    if seq_lens:
        kw["seq_lens"] = tuple(seq_lens)
    execute(
        "sweep throughput",
        lambda say: throughput_sweep(
            model_size, steps=steps, overrides=overrides, peak_tflops=peak_tflops, progress=say, **kw
        ),
        json_out,
        render_throughput,
        plot=plot_throughput,
        plot_path=default_plot(plot, no_plot, "throughput_sweep"),
    )


@app.command("vram")
def vram_cmd(
    model_size: ModelSize = "100M",
    batch_size: Annotated[int, opt("--batch_size", help="Sequences per step.", min=1)] = 8,
    start_seq: Annotated[int, opt("--start_seq", help="First sequence length.", min=2)] = 1024,
    max_seq: Annotated[int, opt("--max_seq", help="Longest sequence length tried.", min=2)] = 32768,
    refine_steps: Annotated[
        int, opt("--refine_steps", help="Bisection steps after the first OOM.", min=0)
    ] = 3,
    overrides: Overrides = None,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Peak training memory against sequence length (doubling from --start_seq until a step runs out
    of memory, then bisecting) and the longest length that fits, beside hydra-model's analytic
    estimate. Needs CUDA. PNG: memory against sequence length with the device capacity."""
    require_cuda("hydra-diag sweep vram")
    from hydra_diag.model_bench import render_vram, vram_sweep
    from hydra_diag.plots_gpu import plot_vram

    execute(
        "sweep vram",
        lambda say: vram_sweep(
            model_size, batch_size, start_seq, max_seq, refine_steps, overrides=overrides, progress=say
        ),
        json_out,
        render_vram,
        plot=plot_vram,
        plot_path=default_plot(plot, no_plot, "vram_sweep"),
    )


@app.command("knobs")
def knobs_cmd(
    knobs: Annotated[
        list[str] | None,
        opt(
            "--knob",
            help="NAME=V1,V2,... (repeatable): a TrainConfig field (lr, warmup_steps ...) or a "
            "HydraConfig field (mod_capacity, recursions_per_block ...). Default: lr and mod_capacity.",
        ),
    ] = None,
    model_size: Annotated[
        str | None, opt("--model_size", help="Preset (default debug on CUDA, tiny on CPU).")
    ] = None,
    overrides: Overrides = None,
    steps: Annotated[
        int | None, opt("--steps", help="Steps per run (default 100 CUDA / 12 CPU).", min=2)
    ] = None,
    grid: Annotated[bool, opt("--grid", help="Every combination instead of one knob at a time.")] = False,
    dataset: Annotated[str, opt("--dataset", help="synthetic, or a hydra-train dataset.")] = "synthetic",
    device: Device = "auto",
    seed: Seed = 1337,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Short hydra-train runs over hyperparameter values, one knob at a time around a baseline (or the
    full --grid); ranks them by final validation loss. CPU (tiny, narrowed) or CUDA. PNG: validation
    loss against each knob's values."""
    from hydra_diag.knobs import render_knobs, sweep_knobs
    from hydra_diag.loading import parse_overrides
    from hydra_diag.plots_run import plot_knobs

    execute(
        "sweep knobs",
        lambda say: sweep_knobs(
            knobs,
            model_size,
            parse_overrides(overrides) or None,
            steps,
            grid,
            dataset,
            device=device,
            seed=seed,
            progress=say,
        ),
        json_out,
        render_knobs,
        plot=plot_knobs,
        plot_path=default_plot(plot, no_plot, "knob_sweep"),
        failed=lambda r: (
            False
            if r["best"]
            else "sweep knobs: no run finished with a validation loss (see the error column)"
        ),
    )
