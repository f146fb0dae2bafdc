"""``hydra-diag health``: model and routing health checks."""

from typing import Annotated

from hydra_diag.cliutil import (
    CheckpointOpt,
    DatasetOpt,
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
    within,
)
from hydra_kernels.cli_support import new_app

app = new_app("Model and routing health checks (CPU-friendly).")

BatchSize = Annotated[int, opt("--batch_size", help="Sequences per batch.", min=1)]
SeqLen = Annotated[
    int, opt("--seq_len", help="Tokens per sequence (capped at the model's max_seq_len).", min=2)
]


@app.command("model")
def health_model(
    model_size: ModelSize = "tiny",
    overrides: Overrides = None,
    checkpoint: CheckpointOpt = None,
    device: Device = "cpu",
    batch_size: BatchSize = 2,
    seq_len: SeqLen = 64,
    seed: Seed = 0,
    loss_tolerance: Annotated[
        float,
        opt("--loss_tolerance", **within("Allowed |initial CE − ln V| in nats.", 0, lo_open=True)),
    ] = 0.5,
    json_out: JsonOut = False,
) -> None:
    """Is the model sound before training? Parameter counts (distinct tensors; the preset against the
    seed table at vocab 32000), initialisation statistics against hydra-model's documented init (NaN/Inf
    only for a checkpoint), a finite training forward/backward with a gradient for every parameter,
    initial loss ≈ ln V, and eval-mode causality. Needs only a CPU. Exit 1 when a check fails."""
    from hydra_diag.health import model_health_check, render_model_health

    execute(
        "health model",
        lambda say: model_health_check(
            model_size, overrides, checkpoint, device, batch_size, seq_len, seed, loss_tolerance, progress=say
        ),
        json_out,
        render_model_health,
        failed=lambda r: not r["passed"],
    )


@app.command("routing")
def health_routing(
    model_size: ModelSize = "tiny",
    overrides: Overrides = None,
    checkpoint: CheckpointOpt = None,
    dataset: DatasetOpt = None,
    device: Device = "auto",
    batch_size: BatchSize = 4,
    seq_len: SeqLen = 128,
    n_batches: Annotated[int, opt("--batches", help="Batches to average over.", min=1)] = 2,
    seed: Seed = 0,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """How the routers behave, in training and eval mode (causal routing: the same causal threshold
    rule in both; expert choice: top-k, then a threshold): MoD selected fraction against capacity
    and the spread of router scores, the MoR depth distribution against the
    capacity schedule, MoE expert utilisation; flags collapsed routers, all-or-none selection, dead or
    dominant experts. On a fresh preset or a checkpoint (CPU or CUDA). PNG: heat maps per layer.
    Exit 1 when an error-level problem is found."""
    from hydra_diag.plots_model import plot_routing
    from hydra_diag.routing_health import render_routing_health, routing_health

    execute(
        "health routing",
        lambda say: routing_health(
            model_size,
            overrides,
            checkpoint,
            dataset,
            device,
            batch_size,
            seq_len,
            n_batches,
            seed,
            progress=say,
        ),
        json_out,
        render_routing_health,
        plot=plot_routing,
        plot_path=default_plot(plot, no_plot, "routing_health"),
        failed=lambda r: not r["healthy"],
    )
