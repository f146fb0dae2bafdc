"""``hydra-diag eval``: checkpoint evaluation and short-run sanity checks."""

from typing import Annotated

from hydra_diag.cliutil import (
    DatasetOpt,
    Device,
    JsonOut,
    ModelSize,
    Overrides,
    Seed,
    execute,
    one_of,
    opt,
    within,
)
from hydra_kernels.cli_support import new_app

app = new_app("Evaluate checkpoints; check that a configuration can learn.")


@app.command("checkpoint")
def eval_checkpoint_cmd(
    checkpoint: Annotated[
        str, opt("--checkpoint", help="Checkpoint file, save_pretrained folder or run folder.")
    ],
    dataset: DatasetOpt = None,
    tokenizer: Annotated[str | None, opt("--tokenizer", help="tokenizer.json for text data.")] = None,
    batch_size: Annotated[
        int | None, opt("--batch_size", help="Sequences per batch (default: the run's).", min=1)
    ] = None,
    seq_len: Annotated[
        int | None, opt("--seq_len", help="Tokens per sequence (default: the run's).", min=2)
    ] = None,
    n_batches: Annotated[
        int | None,
        opt("--batches", help="Batches to evaluate (default: the run's --eval_batches).", min=1),
    ] = None,
    split: Annotated[
        str, opt("--split", help="The data split: val or train.", **one_of("val", "train"))
    ] = "val",
    routing: Annotated[
        str,
        opt("--routing", help="eval (causal thresholds) or train (top-k).", **one_of("eval", "train")),
    ] = "eval",
    device: Device = "auto",
    json_out: JsonOut = False,
) -> None:
    """Validation loss, perplexity and bits per token of a checkpoint, on the run's own validation
    batches by default (so it can be compared with the loss the run logged, shown beside it). CUDA with
    bf16 autocast when present, else the CPU in fp32. Needs the checkpoint and its data (or --dataset)."""
    from hydra_diag.evaluation import eval_checkpoint, render_eval_checkpoint

    execute(
        "eval checkpoint",
        lambda say: eval_checkpoint(
            checkpoint,
            dataset,
            tokenizer,
            batch_size,
            seq_len,
            n_batches,
            split,
            routing,
            device,
            progress=say,
        ),
        json_out,
        render_eval_checkpoint,
    )


@app.command("sanity")
def eval_sanity_cmd(
    model_size: ModelSize = "tiny",
    overrides: Overrides = None,
    device: Device = "auto",
    batch_size: Annotated[int, opt("--batch_size", help="Sequences per batch.", min=1)] = 4,
    seq_len: Annotated[int, opt("--seq_len", help="Tokens per sequence.", min=2)] = 64,
    overfit_steps: Annotated[int, opt("--overfit_steps", help="Steps on the single batch.", min=2)] = 60,
    overfit_ratio: Annotated[
        float,
        opt("--overfit_ratio", **within("Final loss must be ≤ this × the first.", 0, 1, lo_open=True)),
    ] = 0.5,
    run_steps: Annotated[int, opt("--run_steps", help="Steps of the short hydra-train run.", min=2)] = 30,
    min_drop: Annotated[
        float,
        opt("--min_drop", **within("Relative drop of the validation loss required.", 0, 1, hi_open=True)),
    ] = 0.05,
    dataset: Annotated[
        str, opt("--dataset", help="Data of the short run (synthetic, or a hydra-train dataset).")
    ] = "synthetic",
    seed: Seed = 0,
    json_out: JsonOut = False,
) -> None:
    """Can this configuration learn? Overfits one batch of random tokens (the loss must fall to
    --overfit_ratio of its start) and trains a short hydra-train run on a learnable stream (the
    validation loss must fall by --min_drop, with no non-finite step). CPU or CUDA. Exit 1 on failure."""
    from hydra_diag.evaluation import eval_sanity, render_eval_sanity

    execute(
        "eval sanity",
        lambda say: eval_sanity(
            model_size,
            overrides,
            device,
            batch_size,
            seq_len,
            overfit_steps,
            overfit_ratio=overfit_ratio,
            run_steps=run_steps,
            min_drop=min_drop,
            dataset=dataset,
            seed=seed,
            progress=say,
        ),
        json_out,
        render_eval_sanity,
        failed=lambda r: not r["passed"],
    )
