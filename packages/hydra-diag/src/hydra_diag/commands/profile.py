"""``hydra-diag profile``: where a training step's time goes (CUDA only)."""

from typing import Annotated

from hydra_diag.cliutil import JsonOut, ModelSize, NoPlot, Overrides, PlotPath, default_plot, execute, opt
from hydra_kernels.cli_support import new_app, require_cuda

app = new_app("Profiles of a training step: top GPU kernels, CPU vs GPU time (CUDA only).")

BatchSize = Annotated[int, opt("--batch_size", help="Sequences per step.", min=1)]
SeqLen = Annotated[int, opt("--seq_len", help="Tokens per sequence.", min=2)]
Steps = Annotated[int, opt("--steps", help="Profiled steps (after warm-up).", min=1)]


@app.command("kernels")
def kernels_cmd(
    model_size: ModelSize = "100M",
    overrides: Overrides = None,
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 2048,
    steps: Steps = 3,
    top: Annotated[int, opt("--top", help="Kernels to list.", min=1)] = 25,
    trace: Annotated[
        str, opt("--trace", help="Where to write the Chrome trace.")
    ] = "profile_kernels_trace.json",
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """torch.profiler over a few training steps: the top GPU kernels by their own time (calls, ms per
    step, share), kernel time by family (GEMM, attention, hydra Triton, ...), kernel launches per step;
    writes a Chrome trace. Needs CUDA. PNG: the top kernels."""
    require_cuda("hydra-diag profile kernels")
    from hydra_diag.plots_gpu import plot_profile_kernels
    from hydra_diag.profiling import profile_kernels, render_profile_kernels

    execute(
        "profile kernels",
        lambda say: profile_kernels(
            model_size, overrides, batch_size, seq_len, steps=steps, top=top, trace=trace, progress=say
        ),
        json_out,
        render_profile_kernels,
        plot=plot_profile_kernels,
        plot_path=default_plot(plot, no_plot, "profile_kernels"),
    )


@app.command("python-overhead")
def python_overhead_cmd(
    model_size: ModelSize = "100M",
    overrides: Overrides = None,
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 2048,
    modes: Annotated[list[str] | None, opt("--mode", help="eager, compile (repeatable).")] = None,
    steps: Steps = 5,
    json_out: JsonOut = False,
) -> None:
    """CPU time against GPU time per training step: synchronised wall time, GPU busy time (sum of kernel
    durations), host time to issue the step, GPU idle share, kernel launches per step, and whether the
    step is CPU- or GPU-bound; eager and/or compiled. Needs CUDA."""
    require_cuda("hydra-diag profile python-overhead")
    from hydra_diag.profiling import python_overhead, render_python_overhead

    execute(
        "profile python-overhead",
        lambda say: python_overhead(
            model_size, overrides, batch_size, seq_len, tuple(modes or ("eager",)), steps=steps, progress=say
        ),
        json_out,
        render_python_overhead,
    )
