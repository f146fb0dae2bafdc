"""The `hydra-train` command line: `run` (train), `pretest` (SafeOptimizations' pretests alone, their
history and OPTIMIZATIONS.md), the `db` group (query the metrics database) and `tokenizer train`
(a BPE for the user's own text, cli_tokenizer).

Every option accepts the seed documents' underscore spelling and Typer's kebab-case
(``--max_steps`` and ``--max-steps``). Nothing heavy is imported until a command runs.
"""

from pathlib import Path
from typing import Annotated

from hydra_kernels.cli_support import add_version_option, console, emit_json, err_console, fail, new_app
from hydra_kernels.cli_support import opt as _opt
from hydra_train import __version__
from hydra_train.cli_options import (
    Arch,
    BatchSize,
    BlockKV,
    BlockQ,
    CheckpointDir,
    CheckpointEvery,
    ChunkedCe,
    Compile,
    CompileScope,
    CpuThreads,
    Debug,
    Device,
    DropThreshold,
    EightBitAdam,
    Fp8Format,
    Fp8Scaling,
    GradAccum,
    GraphWarmup,
    Lr,
    MaxSkippedSteps,
    ModelOverride,
    ModelSize,
    Moe,
    NumWarps,
    Precision,
    PrefetchThreads,
    PretestSteps,
    PretestWarmup,
    SafeBlackwell,
    SafeCudaGraphs,
    SafeFa3,
    SafeFp8,
    SafetyWindow,
    Seed,
    SeqLen,
    SkipPretest,
    SpikeThreshold,
    StaticRouting,
    TritonKernels,
    VocabSize,
    parse_model_overrides,
)

app = new_app("Train HYDRA models: hydra-train run, pretests, metrics database.")
add_version_option(app, "hydra-train", __version__)


#: Help text of the options only `run` takes (kept here so the signature stays readable); the ones
#: `run` and `pretest` share are types in cli_options.
H = {
    "mode": (
        "testing: defaults for a run of minutes; production: long-run defaults (100k steps, eval/save "
        "every 1000)."
    ),
    "max_steps": (
        "Optimizer steps to train (default: testing mode 120 on CPU, 300 on a GPU; production 100000)."
    ),
    "lr_schedule": "cosine (warmup + cosine) or wsd (warmup-stable-decay).",
    "warmup_steps": "Linear warmup steps (default 5% of max_steps, at most 1000).",
    "min_lr_ratio": "Final learning rate as a fraction of the peak.",
    "wsd_decay_frac": "wsd: fraction of the steps spent decaying at the end.",
    "weight_decay": "AdamW weight decay (matrices only).",
    "grad_clip": "Clip the global gradient norm to this (0: no clipping).",
    "save_every": "Write a checkpoint every N steps.",
    "keep_checkpoints": "Keep the last K step checkpoints (0: all); the final one is always kept.",
    "resume": "Continue from the newest valid checkpoint in --checkpoint_dir.",
    "dataset": (
        "stdlib / stdlib-full / pyenv (embedded), a name under $HYDRA_DATA_ROOT, a path to data (.bin "
        ".pt .jsonl .txt .parquet .arrow, or a folder of them) or a Hugging Face save_to_disk folder."
    ),
    "tokenizer": (
        "tokenizer.json for text data (default: the tokenizer.json in the data folder, as "
        "hydra-train tokenizer train writes it)."
    ),
    "text_column": "The text field of .jsonl lines, .parquet/.arrow tables and HF datasets.",
    "moe_num_experts": "Experts per MoE layer.",
    "eval_every": "Validation every N steps (also at the start and the end).",
    "eval_batches": "Validation batches per evaluation.",
    "log_every": "Read losses, write the database and the progress every N steps.",
    "fsdp": "Shard parameters, gradients and optimizer state with FSDP2 (under torchrun).",
    "prefetch_buffer_size": "Batches built ahead.",
    "tensorboard": "Also log scalars to TensorBoard (run folder).",
    "wandb": "Also log to Weights & Biases (offline unless WANDB_MODE says otherwise).",
    "json_out": "Print the final summary as JSON instead of a table.",
    "dry_run": "Print the resolved configuration and the optimizations that would be pretested, then "
    "exit (no data, no model); --device cuda works without a GPU.",
    "start": "First step to show.",
    "limit": "At most this many rows, evenly spaced (0: all).",
}


@app.command("run")
def run(
    arch: Arch = "hydra",
    model_size: ModelSize = "auto",
    mode: Annotated[str, _opt("--mode", metavar="testing|production", help=H["mode"])] = "testing",
    max_steps: Annotated[int | None, _opt("--max_steps", help=H["max_steps"])] = None,
    batch_size: BatchSize = None,
    seq_len: SeqLen = None,
    grad_accum: GradAccum = 1,
    lr: Lr = None,
    lr_schedule: Annotated[
        str, _opt("--lr_schedule", "--schedule", metavar="cosine|wsd", help=H["lr_schedule"])
    ] = "cosine",
    warmup_steps: Annotated[int | None, _opt("--warmup_steps", help=H["warmup_steps"])] = None,
    min_lr_ratio: Annotated[float, _opt("--min_lr_ratio", help=H["min_lr_ratio"])] = 0.1,
    wsd_decay_frac: Annotated[float, _opt("--wsd_decay_frac", help=H["wsd_decay_frac"])] = 0.2,
    weight_decay: Annotated[float, _opt("--weight_decay", help=H["weight_decay"])] = 0.1,
    grad_clip: Annotated[float, _opt("--grad_clip", help=H["grad_clip"])] = 1.0,
    eight_bit_adam: EightBitAdam = False,
    checkpoint_every: CheckpointEvery = 0,
    save_every: Annotated[int | None, _opt("--save_every", help=H["save_every"])] = None,
    keep_checkpoints: Annotated[int, _opt("--keep_checkpoints", help=H["keep_checkpoints"])] = 3,
    checkpoint_dir: CheckpointDir = "checkpoints",
    resume: Annotated[bool, _opt("--resume", help=H["resume"])] = False,
    triton_kernels: TritonKernels = None,
    chunked_ce: ChunkedCe = None,
    dataset: Annotated[str, _opt("--dataset", help=H["dataset"])] = "auto",
    tokenizer: Annotated[str | None, _opt("--tokenizer", help=H["tokenizer"])] = None,
    text_column: Annotated[str, _opt("--text_column", help=H["text_column"])] = "text",
    vocab_size: VocabSize = None,
    moe: Moe = False,
    moe_num_experts: Annotated[int, _opt("--moe_num_experts", help=H["moe_num_experts"])] = 4,
    static_routing_mode: StaticRouting = False,
    compile: Compile = False,
    eval_every: Annotated[int | None, _opt("--eval_every", help=H["eval_every"])] = None,
    eval_batches: Annotated[int, _opt("--eval_batches", help=H["eval_batches"])] = 8,
    log_every: Annotated[int | None, _opt("--log_every", help=H["log_every"])] = None,
    seed: Seed = 1337,
    precision: Precision = "auto",
    device: Device = "auto",
    cpu_threads: CpuThreads = None,
    fsdp: Annotated[bool, _opt("--fsdp", help=H["fsdp"])] = False,
    prefetch_threads: PrefetchThreads = 4,
    prefetch_buffer_size: Annotated[int, _opt("--prefetch_buffer_size", help=H["prefetch_buffer_size"])] = 8,
    tensorboard: Annotated[bool, _opt("--tensorboard", help=H["tensorboard"])] = False,
    wandb: Annotated[bool, _opt("--wandb", help=H["wandb"])] = False,
    model_override: ModelOverride = None,
    json_out: Annotated[bool, _opt("--json", help=H["json_out"])] = False,
    experimental_fa3: SafeFa3 = True,
    experimental_cuda_graphs: SafeCudaGraphs = True,
    cuda_graphs_warmup: GraphWarmup = 50,
    experimental_blackwell_tuning: SafeBlackwell = True,
    triton_block_q: BlockQ = None,
    triton_block_kv: BlockKV = None,
    triton_num_warps: NumWarps = None,
    experimental_fp8: SafeFp8 = False,
    fp8_format: Fp8Format = "e4m3",
    fp8_scaling: Fp8Scaling = "row",
    compile_scope: CompileScope = "blocks",
    experimental_safety_window: SafetyWindow = 100,
    experimental_loss_spike_threshold: SpikeThreshold = 2.0,
    experimental_throughput_drop_threshold: DropThreshold = 0.5,
    experimental_skip_pretest: SkipPretest = False,
    pretest_warmup_steps: PretestWarmup = 2,
    pretest_steps: PretestSteps = 4,
    max_skipped_steps: MaxSkippedSteps = 3,
    debug: Debug = False,
    dry_run: Annotated[bool, _opt("--dry_run", help=H["dry_run"])] = False,
) -> None:
    """Train a HYDRA model. With no options: the tiny preset on the Python standard library's own
    source (tokenizer built and cached on first use), a few minutes on a laptop CPU; on a GPU a larger
    preset with bf16 autocast. Checkpoints, training.db and run artifacts go to --checkpoint_dir.
    Multi-GPU: torchrun --nproc_per_node=N -m hydra_train run ... (DDP; --fsdp for FSDP2)."""
    from hydra_train.cli_errors import run_guarded
    from hydra_train.config import TrainConfig
    from hydra_train.run import run_training, summary_rows

    cfg = TrainConfig(
        arch=arch,
        model_size=model_size,
        mode=mode,
        max_steps=max_steps,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        lr=lr,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
        wsd_decay_frac=wsd_decay_frac,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        eight_bit_adam=eight_bit_adam,
        checkpoint_every=checkpoint_every,
        save_every=save_every,
        keep_checkpoints=keep_checkpoints,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        triton_kernels=triton_kernels,
        chunked_ce=chunked_ce,
        dataset=dataset,
        tokenizer=tokenizer,
        text_column=text_column,
        vocab_size=vocab_size,
        moe=moe,
        moe_num_experts=moe_num_experts,
        static_routing_mode=static_routing_mode,
        compile=compile,
        eval_every=eval_every,
        eval_batches=eval_batches,
        log_every=log_every,
        seed=seed,
        precision=precision,
        device=device,
        cpu_threads=cpu_threads,
        fsdp=fsdp,
        experimental_prefetch_threads=prefetch_threads,
        prefetch_buffer_size=prefetch_buffer_size,
        tensorboard=tensorboard,
        wandb=wandb,
        model_overrides=parse_model_overrides(model_override),
        progress=not json_out,
        experimental_fa3=experimental_fa3,
        experimental_cuda_graphs=experimental_cuda_graphs,
        cuda_graphs_warmup=cuda_graphs_warmup,
        experimental_blackwell_tuning=experimental_blackwell_tuning,
        triton_block_q=triton_block_q,
        triton_block_kv=triton_block_kv,
        triton_num_warps=triton_num_warps,
        experimental_fp8=experimental_fp8,
        fp8_format=fp8_format,
        fp8_scaling=fp8_scaling,
        compile_scope=compile_scope,
        experimental_safety_window=experimental_safety_window,
        experimental_loss_spike_threshold=experimental_loss_spike_threshold,
        experimental_throughput_drop_threshold=experimental_throughput_drop_threshold,
        experimental_skip_pretest=experimental_skip_pretest,
        pretest_warmup_steps=pretest_warmup_steps,
        pretest_steps=pretest_steps,
        max_skipped_steps=max_skipped_steps,
    )
    if dry_run:
        _print_dry_run(run_guarded(lambda: _dry_run(cfg), debug=debug, resume_hint=""), json_out)
        return
    summary = run_guarded(
        lambda: run_training(cfg, console=err_console if json_out else console),
        debug=debug,
        resume_hint=f"hydra-train run --resume --checkpoint_dir {checkpoint_dir}",
    )
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return
    if json_out:
        emit_json(summary)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title="hydra-train run: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # long paths wrap whole at 80 columns, never cut
    for k, v in summary_rows(summary):
        table.add_row(k, Text(v))  # literal: a path with "[...]" is not markup
    console.print(table)


def _dry_run(cfg):
    from hydra_train.dry_run import dry_run

    return dry_run(cfg)


def _print_dry_run(report: dict, json_out: bool) -> None:
    if json_out:
        emit_json(report)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"hydra-train run --dry_run ({report['device_note']})", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for k, v in report["fast_path"].items():
        table.add_row(k, Text(str(v)))
    table.add_row("requested (pretested where they apply)", Text(", ".join(report["would_pretest"]) or "-"))
    for k in ("arch", "model_size", "batch_size", "seq_len", "max_steps", "lr", "dataset"):
        table.add_row(k, Text(str(report["config"].get(k))))
    console.print(table)


db_app = new_app("Query the metrics database (<checkpoint_dir>/training.db).")
app.add_typer(db_app, name="db")

CkptDir = Annotated[
    str, _opt("--checkpoint_dir", help="Folder holding training.db and the diagnostics_*.json exports.")
]
Model = Annotated[str | None, _opt("--model", help="Only this model id (e.g. tiny, 100m).")]
Json = Annotated[bool, _opt("--json", help="Machine-readable output.")]


def _open_db(checkpoint_dir: str):
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    path = Path(checkpoint_dir) / DB_NAME
    if not path.is_file():
        fail(
            f"no metrics database at {path}; train first (hydra-train run) or rebuild it "
            "(hydra-train db rebuild)"
        )
    from hydra_train.errors import HydraTrainError

    try:
        return TrainingDB(path, read_only=True)
    except HydraTrainError as exc:
        fail(str(exc))


def _table(title: str, rows: list[dict], columns: list[str]) -> None:
    from hydra_kernels.cli_format import print_records

    print_records(console, title, rows, columns)


@db_app.command("stats")
def db_stats(checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False) -> None:
    """Per model: runs, logged steps, last step, best and last loss, EMAs, best validation loss."""
    with _open_db(checkpoint_dir) as db:
        rows = db.stats(model)
    if json_out:
        return emit_json(rows)
    _table(
        "models",
        rows,
        [
            "model_id",
            "params",
            "runs",
            "logged_steps",
            "last_step",
            "tokens_seen",
            "best_loss",
            "last_loss",
            "ema_short",
            "ema_long",
            "best_val_loss",
        ],
    )


@db_app.command("milestones")
def db_milestones(
    checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False
) -> None:
    """The first step at which the short-EMA loss went below each threshold."""
    with _open_db(checkpoint_dir) as db:
        rows = db.milestones(model)
    if json_out:
        return emit_json(rows)
    _table(
        "loss milestones (ema_short)",
        rows,
        ["model_id", "threshold", "step", "tokens_seen", "ema_short", "run_id"],
    )


@db_app.command("ema")
def db_ema(
    checkpoint_dir: CkptDir = "checkpoints",
    model: Model = None,
    start: Annotated[int, _opt("--start", help=H["start"])] = 0,
    limit: Annotated[int, _opt("--limit", help=H["limit"])] = 40,
    json_out: Json = False,
) -> None:
    """Loss with its short (0.99), medium (0.999) and long (0.9999) EMAs from --start on."""
    with _open_db(checkpoint_dir) as db:
        rows = db.ema(model, start=start, limit=limit)
    if json_out:
        return emit_json(rows)
    _table(
        f"multi-scale EMA from step {start}",
        rows,
        ["model_id", "step", "loss", "ema_short", "ema_medium", "ema_long", "run_id"],
    )


@db_app.command("runs")
def db_runs(checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False) -> None:
    """Every run: status, steps, best and final validation loss, tokens/s, what it resumed from."""
    with _open_db(checkpoint_dir) as db:
        rows = db.runs(model)
    if json_out:
        return emit_json(rows)
    _table(
        "runs",
        rows,
        [
            "run_id",
            "model_id",
            "status",
            "start_step",
            "end_step",
            "best_loss",
            "final_val_loss",
            "tokens_per_s",
            "resumed_from",
            "device",
        ],
    )


@db_app.command("rebuild")
def db_rebuild(checkpoint_dir: CkptDir = "checkpoints", json_out: Json = False) -> None:
    """Recreate training.db from the diagnostics_*.json exports in --checkpoint_dir."""
    from hydra_train.metrics_db import rebuild_database

    try:
        path, run_ids = rebuild_database(checkpoint_dir)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        return emit_json({"database": str(path), "runs": run_ids})
    console.print(f"rebuilt {path} from {len(run_ids)} export(s): {', '.join(run_ids)}", highlight=False)


from hydra_train.cli_pretest import pretest  # noqa: E402  (defined beside, registered here)

app.command("pretest")(pretest)

from hydra_train.cli_tokenizer import tokenizer_app  # noqa: E402

app.add_typer(tokenizer_app, name="tokenizer")
