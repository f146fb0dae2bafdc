"""The five sections of a run's configuration, each field with its command-line flag.

Every knob of ``hydra-train run`` is one field here, declared once with its default, its flag
spellings, metavar and help (``metadata["cli"]``); :mod:`hydra_train.cli_options` turns the fields
into the options of ``hydra-train run`` and ``hydra-train pretest`` (``commands`` says which take
it), and :class:`hydra_train.config.TrainConfig` holds one instance of each section. A new knob is
a new field in its section: the flag, the stored config and ``--dry_run`` follow.

A logger's flag is declared with the logger (:mod:`hydra_train.loggers`) and lands in the runtime
section. ``None`` (or ``"auto"``) means: chosen for the device and mode by
:func:`hydra_train.config.resolve_config`. No torch and no Typer here: ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hydra_train.config_defaults import TESTING_DEFAULTS, device_default
from hydra_train.config_fields import BOTH, PRETEST, RUN, CliSpec, flag  # noqa: F401 (re-exported)
from hydra_train.config_optimizations import (  # noqa: F401 (re-exported: config.py reads them here)
    COMPILE_TOKENS,
    COMPILE_TOKENS_DDP,
    WHOLE_MODEL_COMPILE_TOKENS,
    WHOLE_MODEL_COMPILE_TOKENS_DDP,
    OptimizationOptions,
)
from hydra_train.loggers import LOGGERS


@dataclass
class ModelOptions:
    """The model: architecture, preset and what the flags change in its HydraConfig."""

    #: "hydra" (CCGQA + MoD/MoR routing) or "gpt" (the dense baseline); hydra_model.ARCHITECTURES
    arch: str = flag(
        "hydra",
        "--arch",
        metavar="hydra|gpt",
        help="Architecture: hydra (CCGQA + MoD/MoR routing) or gpt (the dense baseline: unique "
        "pre-norm layers, GQA, SwiGLU, RoPE; presets of the same sizes).",
    )
    model_size: str = flag(
        "auto",
        "--model_size",
        metavar="SIZE",
        help="Model preset: tiny, debug, 100M, 250M, 500M, 1B, or auto (tiny on CPU; by GPU memory on CUDA).",
    )
    moe: bool = flag(False, "--moe", help="Mixture-of-Experts FFNs instead of the dense MLP.")
    moe_num_experts: int = flag(4, "--moe_num_experts", help="Experts per MoE layer.", commands=(RUN,))
    static_routing_mode: bool = flag(
        False,
        "--static_routing_mode",
        help="Soft routing: every token through every block (fixed shapes, CUDA-graph friendly).",
    )
    #: fused linear + cross-entropy; None = on with CUDA, off on the CPU (the fast path by default)
    chunked_ce: bool | None = flag(
        None,
        "--chunked_ce",
        switch=True,
        help="Loss via hydra_kernels.linear_cross_entropy: no full [tokens, vocab] logits "
        "(default: on with CUDA, off on the CPU).",
    )
    vocab_size: int | None = flag(
        None,
        "--vocab_size",
        help="Vocabulary size (embedded corpus: of the BPE built for it, at least 300; "
        f"{device_default('vocab_size')}; other data: the tokenizer's, meta.json's or the preset's).",
    )
    model_overrides: dict[str, Any] = flag(  # noqa: RUF009 - flag() is a dataclasses.field
        None,
        "--model_override",
        factory=dict,
        cli_type=list[str] | None,
        help="Set any HydraConfig field, FIELD=VALUE (repeatable), e.g. dim=128.",
    )
    checkpoint_every: int = flag(
        0,
        "--checkpoint_every",
        help="Activation checkpointing every N blocks (0: off). Saves memory, costs a recompute.",
    )


@dataclass
class OptimOptions:
    """The optimizer step and the learning-rate schedule."""

    lr: float | None = flag(
        None, "--lr", help="Peak learning rate (default by preset: tiny 3e-3 ... 1B 3e-4)."
    )
    min_lr_ratio: float = flag(
        0.1, "--min_lr_ratio", help="Final learning rate as a fraction of the peak.", commands=(RUN,)
    )
    warmup_steps: int | None = flag(
        None,
        "--warmup_steps",
        help="Linear warmup steps (default 5% of max_steps, at most 1000).",
        commands=(RUN,),
    )
    lr_schedule: str = flag(
        "cosine",
        "--lr_schedule",
        "--schedule",
        metavar="cosine|wsd",
        help="cosine (warmup + cosine) or wsd (warmup-stable-decay).",
        commands=(RUN,),
    )
    wsd_decay_frac: float = flag(
        0.2, "--wsd_decay_frac", help="wsd: fraction of the steps spent decaying at the end.", commands=(RUN,)
    )
    weight_decay: float = flag(
        0.1, "--weight_decay", help="AdamW weight decay (matrices only).", commands=(RUN,)
    )
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = flag(
        1.0, "--grad_clip", help="Clip the global gradient norm to this (0: no clipping).", commands=(RUN,)
    )
    grad_accum: int = flag(1, "--grad_accum", help="Micro-batches accumulated per optimizer step.")
    #: stop as failed after this many optimizer steps in a row skipped for non-finite loss/gradients
    max_skipped_steps: int = flag(
        3,
        "--max_skipped_steps",
        help="Stop the run as failed once more than N optimizer steps in a row are skipped for "
        "non-finite loss or gradients.",
        commands=(RUN,),
    )


@dataclass
class DataOptions:
    """What the model trains on, and in which batches."""

    dataset: str = flag(
        "auto",
        "--dataset",
        help="stdlib / stdlib-full / pyenv (embedded), a name under $HYDRA_DATA_ROOT, a path to data (.bin "
        ".pt .jsonl .txt .parquet .arrow, or a folder of them) or a Hugging Face save_to_disk folder. "
        f"auto: {TESTING_DEFAULTS['cpu']['dataset']} on the CPU, {TESTING_DEFAULTS['cuda']['dataset']} "
        "on CUDA (the Python standard library's source; -full with its tests).",
    )
    tokenizer: str | None = flag(
        None,
        "--tokenizer",
        help="tokenizer.json for text data (default: the tokenizer.json in the data folder, as "
        "hydra-train tokenizer train writes it).",
        commands=(RUN,),
    )
    text_column: str = flag(
        "text",
        "--text_column",
        help="The text field of .jsonl lines, .parquet/.arrow tables and HF datasets.",
        commands=(RUN,),
    )
    batch_size: int | None = flag(
        None,
        "--batch_size",
        help=f"Sequences per micro-batch per GPU/process ({device_default('batch_size')}).",
    )
    seq_len: int | None = flag(
        None,
        "--seq_len",
        help=f"Tokens per sequence ({device_default('seq_len')}; row-shaped data fixes it itself; at most "
        "the model's max_seq_len).",
    )


#: One boolean flag per registered logger (hydra_train.loggers: the class and its flag, one place).
LoggerFlags = dataclasses.make_dataclass(
    "LoggerFlags",
    [(name, bool, flag(False, f"--{name}", help=cls.help, commands=(RUN,))) for name, cls in LOGGERS.items()],
)


@dataclass
class RuntimeOptions(LoggerFlags):
    """How long, where and how the run goes: device, precision, evaluation, logging (the loggers'
    flags come from hydra_train.loggers), checkpoints."""

    mode: str = flag(
        "testing",
        "--mode",
        metavar="testing|production",
        help="testing: defaults for a run of minutes; production: long-run defaults (100k steps, eval/save "
        "every 1000).",
        commands=(RUN,),
    )
    max_steps: int | None = flag(
        None,
        "--max_steps",
        help=f"Optimizer steps to train ({device_default('max_steps')}).",
        commands=(RUN,),
    )
    precision: str = flag(
        "auto",
        "--precision",
        metavar="auto|bf16|fp32",
        help="auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32.",
    )
    device: str = flag("auto", "--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:N.")
    cpu_threads: int | None = flag(
        None,
        "--cpu_threads",
        help="CPU training: intra-op threads (default: the cores the load average leaves idle).",
    )
    fsdp: bool = flag(
        False,
        "--fsdp",
        help="Shard parameters, gradients and optimizer state with FSDP2 (under torchrun).",
        commands=(RUN,),
    )
    ddp_grad_sync: str = flag(
        "auto",
        "--ddp_grad_sync",
        metavar="auto|reducer|allreduce",
        help="Under torchrun with DDP, who averages the gradients: auto (DDP's reducer while no CUDA "
        "graph is enabled; a hand-rolled all-reduce from enabling on, warm-up steps included), "
        "reducer (DDP's always; no CUDA graphs under DDP) or allreduce (hand-rolled always).",
        commands=(RUN,),
    )
    ddp_find_unused_parameters: bool = False
    eval_every: int | None = flag(
        None,
        "--eval_every",
        help=f"Validation every N steps, also at the start and the end ({device_default('eval_every')}).",
        commands=(RUN,),
    )
    eval_batches: int = flag(
        8,
        "--eval_batches",
        help="Validation batches per evaluation, per process (as --batch_size): under torchrun each rank "
        "takes N, the first N x ranks x batch_size validation windows in all.",
        commands=(RUN,),
    )
    log_every: int | None = flag(
        None,
        "--log_every",
        help="Read losses, write the database and the progress every N steps "
        f"({device_default('log_every')}).",
        commands=(RUN,),
    )
    save_every: int | None = flag(
        None,
        "--save_every",
        help="Write a checkpoint every N steps; 0: only the final checkpoint "
        f"({device_default('save_every')}).",
        commands=(RUN,),
    )
    keep_checkpoints: int = flag(
        3,
        "--keep_checkpoints",
        help="Keep the last K step checkpoints (0: all); the final one is always kept.",
        commands=(RUN,),
    )
    checkpoint_dir: str = flag(
        "checkpoints", "--checkpoint_dir", help="Where checkpoints, training.db and run artifacts go."
    )
    resume: bool = flag(
        False,
        "--resume",
        help="A switch (no value): continue the run in --checkpoint_dir from its newest valid "
        "checkpoint of this model (none there is an error). To resume another folder's run, pass "
        "that folder as --checkpoint_dir.",
        commands=(RUN,),
    )
    allow_data_change: bool = flag(
        False,
        "--allow_data_change",
        help="A switch (no value), with --resume: continue even though the data differs from the "
        "checkpoint's (shards added, removed or replaced, another --seq_len or tokenizer); the batch "
        "order is recomputed from the data as it is now, so windows may be repeated or skipped. "
        "Without it such a resume is refused.",
        commands=(RUN,),
    )
    seed: int = flag(1337, "--seed", help="Seed for initialisation and data order.")
    progress: bool = True  # the progress bar; ``run --json`` turns it off
    summary_dir: str | None = flag(
        None,
        "--summary_dir",
        help="Also write the final summary as JSON into this folder (train_summary_<model>_<run>.json).",
        commands=(RUN,),
    )


#: The sections, in the order of TrainConfig's attributes and of the commands' options.
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "optim": OptimOptions,
    "data": DataOptions,
    "runtime": RuntimeOptions,
    "optimizations": OptimizationOptions,
}
