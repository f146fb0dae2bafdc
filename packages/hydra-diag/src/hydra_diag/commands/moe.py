"""``hydra-diag moe``: expert specialisation, a run watchdog, expert weight balance."""

from typing import Annotated

from hydra_diag.cliutil import (
    DatasetOpt,
    Device,
    JsonOut,
    NoPlot,
    PlotPath,
    default_plot,
    execute,
    opt,
    within,
)
from hydra_kernels.cli_support import console, new_app

app = new_app("Mixture-of-Experts diagnostics.")

Checkpoint = Annotated[
    str, opt("--checkpoint", help="Checkpoint file, save_pretrained folder or run folder.")
]


@app.command("specialization")
def specialization_cmd(
    checkpoint: Checkpoint,
    mode: Annotated[
        str,
        opt(
            "--mode",
            metavar="inference|weights",
            help="inference (forward on data) or weights (no GPU, no data).",
        ),
    ] = "inference",
    dataset: DatasetOpt = None,
    tokenizer: Annotated[str | None, opt("--tokenizer", help="tokenizer.json to show token text.")] = None,
    batch_size: Annotated[int, opt("--batch_size", help="Sequences per batch.", min=1)] = 8,
    seq_len: Annotated[int, opt("--seq_len", help="Tokens per sequence.", min=2)] = 256,
    n_batches: Annotated[int, opt("--batches", help="Batches to run.", min=1)] = 4,
    routing: Annotated[
        str, opt("--routing", metavar="eval|train", help="eval (causal thresholds) or train (top-k).")
    ] = "eval",
    min_count: Annotated[
        int, opt("--min_count", help="Occurrences for a token to count in the purity.", min=1)
    ] = 5,
    device: Device = "auto",
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """What the experts specialise in. inference: the model on data batches (CUDA when present, else
    the CPU); per layer and expert the share of assignments, mean router probability, most frequent
    tokens and the token purity (how far the expert is a function of the token). weights: pairwise
    cosine similarity of expert weights and router rows per layer, from the checkpoint alone (CPU).
    PNG: shares or similarity heat maps."""
    from hydra_diag.moe_analysis import (
        render_specialization,
        specialization_inference,
        specialization_weights,
    )
    from hydra_diag.output import DiagError
    from hydra_diag.plots_model import plot_specialization

    def compute(say):
        if mode == "weights":
            return specialization_weights(checkpoint, progress=say)
        if mode == "inference":
            return specialization_inference(
                checkpoint,
                dataset,
                tokenizer,
                batch_size,
                seq_len,
                n_batches,
                routing,
                min_count=min_count,
                device=device,
                progress=say,
            )
        raise DiagError(f"--mode {mode!r}: use inference or weights")

    execute(
        "moe specialization",
        compute,
        json_out,
        render_specialization,
        plot=plot_specialization,
        plot_path=default_plot(plot, no_plot, f"moe_specialization_{mode}"),
    )


@app.command("watchdog")
def watchdog_cmd(
    checkpoint_dir: Annotated[
        str, opt("--checkpoint_dir", help="The run's folder (training.db, checkpoints).")
    ] = "checkpoints",
    run: Annotated[str | None, opt("--run", help="Run id (default: the most recent).")] = None,
    once: Annotated[bool, opt("--once", help="Look once and exit (scripts, tests).")] = False,
    interval: Annotated[float, opt("--interval", help="Seconds between polls.", min=0.0)] = 30.0,
    max_polls: Annotated[int | None, opt("--max_polls", help="Stop after this many polls.", min=1)] = None,
    window: Annotated[
        int, opt("--window", help="Logged steps an expert must stay dead to be flagged.", min=1)
    ] = 3,
    dead_share: Annotated[
        float,
        opt("--dead_share", **within("Dead below this fraction of the fair share.", 0, 1, hi_open=True)),
    ] = 0.1,
    collapse_share: Annotated[
        float,
        opt(
            "--collapse_share",
            **within("Collapsed when one expert takes this share of the tokens.", 0, 1, lo_open=True),
        ),
    ] = 0.9,
    fail_on_alert: Annotated[
        bool, opt("--fail_on_alert", help="Exit 1 when an error-level alert was raised.")
    ] = False,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Follows a run's folder: reads expert utilisation from its metrics database at every poll and
    each new checkpoint's expert weight norms, and flags dead, collapsing or collapsed experts and low
    router entropy. Polls until the run stops (or --max_polls, Ctrl-C); --once looks a single time.
    Needs only the CPU. PNG: utilisation over steps per layer."""
    from hydra_diag.plots_run import plot_watchdog
    from hydra_diag.watchdog import WatchThresholds, render_watchdog, watch_run

    th = WatchThresholds(window=window, dead_share=dead_share, collapse_share=collapse_share)

    def on_poll(report, new_alerts):
        if json_out:
            return
        for a in new_alerts:
            style = {"error": "red", "warning": "yellow"}.get(a["severity"], "dim")
            console.print(
                f"[{style}]step {a.get('step')} layer {a.get('layer')}: {a['kind']}: {a['message']}[/]",
                highlight=False,
            )

    execute(
        "moe watchdog",
        lambda say: watch_run(
            checkpoint_dir, run, once, interval, max_polls, th, on_poll=on_poll, progress=say
        ),
        json_out,
        render_watchdog,
        plot=plot_watchdog,
        plot_path=default_plot(plot, no_plot, "moe_watchdog"),
        failed=lambda r: fail_on_alert and any(a["severity"] == "error" for a in r["all_alerts"]),
    )


@app.command("weight-balance")
def weight_balance_cmd(
    checkpoint: Checkpoint,
    low: Annotated[
        float, opt("--low", help="Flag experts whose norm is below this × the layer median.")
    ] = 0.5,
    high: Annotated[
        float, opt("--high", help="Flag experts whose norm is above this × the layer median.")
    ] = 2.0,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Per-expert weight norms of a checkpoint (gate/up, down, router row, balance bias), their ratio to
    the layer median and to the initial scale, and the imbalance per layer. CPU only needed.
    PNG: heat maps of layers × experts."""
    from hydra_diag.moe_analysis import render_weight_balance, weight_balance
    from hydra_diag.plots_model import plot_weight_balance

    execute(
        "moe weight-balance",
        lambda say: weight_balance(checkpoint, low, high, progress=say),
        json_out,
        render_weight_balance,
        plot=plot_weight_balance,
        plot_path=default_plot(plot, no_plot, "moe_weight_balance"),
    )
