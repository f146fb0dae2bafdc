"""``hydra-diag analyze``: layer-level diagnosis, run analyses from the metrics DB, scaling fits."""

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
    one_of,
    opt,
    within,
)
from hydra_kernels.cli_support import new_app

app = new_app("Layer-level diagnosis, loss components, learning diagnostics, scaling fits.")

RunFolder = Annotated[
    str,
    opt(
        "--checkpoint_dir",
        "--db",
        help="The run's --checkpoint_dir (holding training.db) or the database file.",
    ),
]
RunId = Annotated[str | None, opt("--run", help="Run id (default: the most recently started run).")]
ModelId = Annotated[str | None, opt("--model", help="Only runs of this model id (e.g. tiny, 100m).")]


@app.command("deep-diagnosis")
def deep_diagnosis_cmd(
    model_size: ModelSize = "tiny",
    overrides: Overrides = None,
    checkpoint: CheckpointOpt = None,
    dataset: DatasetOpt = None,
    device: Device = "auto",
    batch_size: Annotated[int, opt("--batch_size", help="Sequences per batch.", min=1)] = 4,
    seq_len: Annotated[int, opt("--seq_len", help="Tokens per sequence.", min=2)] = 128,
    n_batches: Annotated[int, opt("--batches", help="Micro-batches accumulated into the step.", min=1)] = 1,
    seed: Seed = 0,
    explode_ratio: Annotated[
        float,
        opt(
            "--explode_ratio",
            **within("Gradient norm above this × the median: exploding.", 1, lo_open=True),
        ),
    ] = 100.0,
    dead_ratio: Annotated[
        float,
        opt("--dead_ratio", **within("Gradient norm below this × the median: dead.", 0, 1, hi_open=True)),
    ] = 1e-6,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Gradient flow and activations layer by layer in one training step (no optimizer step): gradient
    and weight norms per block and component, residual-stream RMS through the blocks, each recursion's
    update RMS; flags dead or exploding layers and NaN/Inf. CPU or CUDA (GPU recommended for large
    presets). PNG: norms per layer. Exit 1 when an error-level problem is found."""
    from hydra_diag.deep_diagnosis import deep_diagnosis, render_deep_diagnosis
    from hydra_diag.plots_model import plot_deep_diagnosis

    execute(
        "deep diagnosis",
        lambda say: deep_diagnosis(
            model_size,
            overrides,
            checkpoint,
            dataset,
            device,
            batch_size,
            seq_len,
            n_batches,
            seed,
            dead_ratio,
            explode_ratio,
            progress=say,
        ),
        json_out,
        render_deep_diagnosis,
        plot=plot_deep_diagnosis,
        plot_path=default_plot(plot, no_plot, "deep_diagnosis"),
        failed=lambda r: not r["healthy"],
    )


@app.command("loss-components")
def loss_components_cmd(
    checkpoint_dir: RunFolder = "checkpoints",
    run: RunId = None,
    model: ModelId = None,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Cross-entropy and every auxiliary loss term (MoD/MoR router BCE, router z, ponder, balance
    losses) of a run over its logged steps, read from hydra-train's metrics database; each term's
    weight and share of the loss, and a check that loss = CE + Σ weight·term. Needs only the DB.
    PNG: the components over steps."""
    from hydra_diag.loss_components import analyze_loss_components, render_loss_components
    from hydra_diag.plots_run import plot_loss_components

    execute(
        "loss components",
        lambda say: analyze_loss_components(checkpoint_dir, run, model),
        json_out,
        render_loss_components,
        plot=plot_loss_components,
        plot_path=default_plot(plot, no_plot, "loss_components"),
    )


@app.command("learning")
def learning_cmd(
    checkpoint_dir: RunFolder = "checkpoints",
    run: RunId = None,
    model: ModelId = None,
    spike_factor: Annotated[
        float,
        opt("--spike_factor", **within("Loss above this × its recent EMA is a spike.", 1, lo_open=True)),
    ] = 1.3,
    plateau_frac: Annotated[
        float,
        opt(
            "--plateau_frac",
            **within("Shortest plateau, as a share of the logged steps.", 0, 1, lo_open=True),
        ),
    ] = 0.15,
    plateau_tol: Annotated[
        float,
        opt("--plateau_tol", **within("Relative EMA improvement below which it is flat.", 0, 1)),
    ] = 0.01,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Learning-rate and loss diagnostics of a run from its metrics database: warmup (length,
    monotone lr, loss blow-up), loss spikes against the recent EMA, plateaus, gradient clipping share,
    divergence, overfitting, skipped steps. Needs only the DB. PNG: loss, EMA, lr and grad norm."""
    from hydra_diag.learning import LearningThresholds, analyze_learning, render_learning
    from hydra_diag.plots_run import plot_learning

    th = LearningThresholds(spike_factor=spike_factor, plateau_frac=plateau_frac, plateau_tol=plateau_tol)
    execute(
        "learning diagnostics",
        lambda say: analyze_learning(checkpoint_dir, run, model, th),
        json_out,
        render_learning,
        plot=plot_learning,
        plot_path=default_plot(plot, no_plot, "learning"),
    )


@app.command("scaling")
def scaling_cmd(
    variants: Annotated[
        list[str] | None,
        opt(
            "--variant",
            "--variants",
            help="PRESET[:FIELD=VALUE,...] (repeatable). Default: debug, 100M, 250M "
            "on CUDA; three narrow tiny variants on a CPU.",
        ),
    ] = None,
    steps: Annotated[
        int | None, opt("--steps", help="Training steps per variant (default 60 CUDA / 12 CPU).", min=2)
    ] = None,
    batch_size: Annotated[
        int | None, opt("--batch_size", help="Sequences per step (default 8 CUDA / 4 CPU).", min=1)
    ] = None,
    seq_len: Annotated[
        int | None, opt("--seq_len", help="Tokens per sequence (default 512 CUDA / 32 CPU).", min=2)
    ] = None,
    lr: Annotated[
        float | None,
        opt(
            "--lr",
            **within("Learning rate of every variant (default: hydra-train's per preset).", 0, lo_open=True),
        ),
    ] = None,
    dataset: Annotated[str, opt("--dataset", help="synthetic, or a hydra-train dataset.")] = "synthetic",
    vocab_size: Annotated[
        int | None,
        opt("--vocab_size", help="Synthetic vocabulary (default 32000 CUDA / 512 CPU).", min=2),
    ] = None,
    device: Device = "auto",
    target_params: Annotated[
        float, opt("--target_params", **within("Model size to predict (parameters).", 0, lo_open=True))
    ] = 4e9,
    level: Annotated[
        float, opt("--level", **within("Interval level, e.g. 0.9.", 0, 1, lo_open=True, hi_open=True))
    ] = 0.9,
    uncertainty: Annotated[
        str,
        opt(
            "--uncertainty",
            help="covariance (t intervals) or bootstrap.",
            **one_of("covariance", "bootstrap"),
        ),
    ] = "covariance",
    seed: Seed = 1337,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Trains each variant for the same steps through hydra-train, fits final validation loss against
    parameters and against training FLOPs with power laws (least squares in log space, parameter
    uncertainty from the covariance or a bootstrap), and predicts a 4B model with confidence and
    prediction intervals. CUDA (presets) or CPU (tiny variants). PNG: the fits and the prediction."""
    from hydra_diag.plots_run import plot_scaling
    from hydra_diag.scaling import render_scaling, scaling_analysis

    execute(
        "scaling analysis",
        lambda say: scaling_analysis(
            variants,
            steps,
            batch_size,
            seq_len,
            lr,
            dataset,
            vocab_size,
            device,
            target_params,
            level,
            uncertainty,
            seed,
            progress=say,
        ),
        json_out,
        render_scaling,
        plot=plot_scaling,
        plot_path=default_plot(plot, no_plot, "scaling"),
    )
