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
from dataclasses import dataclass, field
from typing import Any

from hydra_train.loggers import LOGGERS

#: Planned training tokens a process (steps × batch × length × accumulation) from which a CUDA
#: run compiles by default. Measured with ``hydra-train run`` (packages/hydra-train/BENCHMARKS.md,
#: 2026-11-26, 100M, 16 × 1024 tokens a step, one H200, cold caches): without compiling 320K
#: tokens/s; the blocks compiled cost about 19 s of setup for 381K (repaid after about 39M
#: tokens; the H100's earlier 301K against 356K gives 38M); the whole forward about 38 s for 411K,
#: ahead of no compile after about 54M and of the blocks after about 93M. The thresholds leave
#: about twice that, for a slower compiling host. The default 300-step run (4.9M tokens) would
#: take longer with a compile.
COMPILE_TOKENS = 100_000_000
#: The same under torchrun (DDP), per process. Each rank's pretest compiles too; measured on
#: 2 × H100 in one call (BENCHMARKS.md, 2026-11-26): graphed DDP 285.5K tokens/s a GPU without
#: compiling, 336.0K with the blocks compiled, a 13 s compile arm (about 16 s with evaluation's
#: graphs): repaid after about 30M tokens a process. (Before the compile arm was stacked on the
#: kernels it runs with, the arm took 69 s on 2 × H200 and this stood at 400M.)
COMPILE_TOKENS_DDP = 100_000_000
#: Planned tokens from which ``--compile_scope auto`` compiles the whole forward of a single-process
#: run rather than each block (see above: 93M on the H200, about doubled).
WHOLE_MODEL_COMPILE_TOKENS = 200_000_000
#: The same under torchrun (DDP; FSDP2 compiles its blocks), per process. On 2 × H200 in one call
#: (BENCHMARKS.md, 2026-11-26): graphed DDP 516.4K tokens/s a GPU with the blocks compiled, 564.3K
#: with the whole forward; its cold compile arm took 56.5 s against the blocks' 16.5 s: the whole
#: forward is ahead after about 240M tokens a process.
WHOLE_MODEL_COMPILE_TOKENS_DDP = 400_000_000

RUN, PRETEST = "run", "pretest"
BOTH = (RUN, PRETEST)


@dataclass(frozen=True)
class CliSpec:
    """How a field appears on the command line."""

    flags: tuple[str, ...]  # underscore spellings; the kebab ones are added (cli_support.opt)
    help: str
    metavar: str | None = None
    switch: bool = False  # a boolean with its --no- form
    commands: tuple[str, ...] = BOTH
    #: the type the command line parses, when not the field's own (``--model_override``: a list)
    cli_type: Any = None


def flag(default: Any = dataclasses.MISSING, *flags: str, help: str, factory: Any = None, **cli: Any) -> Any:
    """A field with its CLI flag (``switch=True``, ``metavar=``, ``commands=``, ``cli_type=``)."""
    meta = {"cli": CliSpec(tuple(flags), help, **cli)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


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
        help="Vocabulary size (embedded corpus: of the BPE built for it; 4096 on CPU, 32000 on GPU).",
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
        ".pt .jsonl .txt .parquet .arrow, or a folder of them) or a Hugging Face save_to_disk folder.",
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
    batch_size: int | None = flag(None, "--batch_size", help="Sequences per micro-batch per GPU/process.")
    seq_len: int | None = flag(
        None, "--seq_len", help="Tokens per sequence (row-shaped data fixes it itself)."
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
        help="Optimizer steps to train (default: testing mode 120 on CPU, 300 on a GPU; production 100000).",
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
        help="Validation every N steps (also at the start and the end).",
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
        help="Read losses, write the database and the progress every N steps.",
        commands=(RUN,),
    )
    save_every: int | None = flag(
        None, "--save_every", help="Write a checkpoint every N steps.", commands=(RUN,)
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


@dataclass
class OptimizationOptions:
    """What SafeOptimizations is asked for (hydra_train.safe_opts: pretests and the monitor decide
    what runs), with their settings and the monitor's thresholds."""

    #: hydra-kernels' Triton ops; None = on with CUDA (pretested by SafeOptimizations), off on the CPU
    triton_kernels: bool | None = flag(
        None,
        "--triton_kernels",
        switch=True,
        help="hydra-kernels' fused Triton ops, otherwise the PyTorch references (default: on with "
        "CUDA, pretested by SafeOptimizations; off on the CPU).",
    )
    #: None = on for a long run with CUDA (config.compile_by_default)
    compile: bool | None = flag(
        None,
        "--compile",
        switch=True,
        help="torch.compile the model, pretested by SafeOptimizations (default: on with CUDA for a "
        f"run of at least {COMPILE_TOKENS // 10**6}M tokens, {COMPILE_TOKENS_DDP // 10**6}M a "
        "process under torchrun, where its compiling (about 20 s for the blocks, 40 s for the whole "
        "forward at 100M on an H200) pays for itself; off on the CPU). With --fsdp the blocks.",
    )
    compile_scope: str = flag(
        "auto",
        "--compile_scope",
        metavar="auto|blocks|model",
        help="What --compile compiles: blocks (each attention+FFN block, shared code: quick to "
        "compile) or model (the whole forward: faster steps, a longer compile); auto: model for a "
        f"run of at least {WHOLE_MODEL_COMPILE_TOKENS // 10**6}M tokens "
        f"({WHOLE_MODEL_COMPILE_TOKENS_DDP // 10**6}M a process under torchrun), else blocks "
        "(always blocks with --fsdp: each sharded block's gather runs around its compiled forward).",
    )
    eight_bit_adam: bool = flag(
        False,
        "--8bit_adam",
        help="bitsandbytes AdamW8bit; with a message, fused AdamW when bitsandbytes is missing or unusable.",
    )
    experimental_prefetch_threads: int = flag(
        4,
        "--experimental_prefetch_threads",
        help="Threads building batches ahead of the trainer (0: inline).",
    )
    prefetch_buffer_size: int = flag(
        8, "--prefetch_buffer_size", help="Batches built ahead.", commands=(RUN,)
    )
    experimental_fa3: bool = flag(
        True,
        "--experimental_fa3",
        switch=True,
        help="Fastest attention kernel: flash-attn 3/2 when installed, else the fastest SDPA kernel measured "
        "for the shapes (pretested; off: PyTorch's own SDPA choice).",
    )
    experimental_cuda_graphs: bool = flag(
        True,
        "--experimental_cuda_graphs",
        switch=True,
        help="Capture the whole training step as a CUDA graph after --cuda_graphs_warmup steps and replay it "
        "(pretested in the routing mode used).",
    )
    cuda_graphs_warmup: int = flag(
        50, "--cuda_graphs_warmup", help="Eager steps before the CUDA-graph capture."
    )
    experimental_blackwell_tuning: bool = flag(
        True,
        "--experimental_blackwell_tuning",
        switch=True,
        help="hydra-kernels' Blackwell launch table on sm_100/sm_120 (N/A elsewhere).",
    )
    triton_block_q: int | None = flag(
        None, "--triton_block_q", help="Blackwell tuning: Triton BLOCK_Q override."
    )
    triton_block_kv: int | None = flag(
        None, "--triton_block_kv", help="Blackwell tuning: Triton BLOCK_KV override."
    )
    triton_num_warps: int | None = flag(
        None, "--triton_num_warps", help="Blackwell tuning: Triton num_warps override."
    )
    experimental_fp8: bool = flag(
        False,
        "--experimental_fp8",
        switch=True,
        help="FP8 GEMMs in the forward of the model's linear layers "
        "(sm_89+; bf16 backward and master weights).",
    )
    fp8_format: str = flag(
        "e4m3", "--fp8_format", metavar="e4m3|e5m2", help="FP8 format of the forward GEMMs: e4m3 or e5m2."
    )
    fp8_scaling: str = flag(
        "row",
        "--fp8_scaling",
        metavar="row|tensor",
        help="FP8 scales: row (per token / output channel) or tensor.",
    )
    experimental_safety_window: int = flag(
        100,
        "--experimental_safety_window",
        help="Steps an enabled optimization is watched; 3 anomalies in it disable it.",
        commands=(RUN,),
    )
    experimental_loss_spike_threshold: float = flag(
        2.0,
        "--experimental_loss_spike_threshold",
        help="Loss spike: loss > this × its rolling EMA.",
        commands=(RUN,),
    )
    experimental_throughput_drop_threshold: float = flag(
        0.5,
        "--experimental_throughput_drop_threshold",
        help="Throughput drop: tokens/s < this × its rolling EMA.",
        commands=(RUN,),
    )
    experimental_skip_pretest: bool = flag(
        False,
        "--experimental_skip_pretest",
        help="Enable the requested optimizations without pretests (risky).",
        commands=(RUN,),
    )
    reuse_pretests: bool = flag(
        True,
        "--reuse_pretests",
        switch=True,
        help="Reuse the verdicts of an earlier run of the same fingerprint (model, step settings, "
        "device, versions, HYDRA's source) kept in $HYDRA_CACHE_DIR/pretests, instead of pretesting "
        "again in a new checkpoint folder; off: pretest unless this folder has them.",
        commands=(RUN,),
    )
    pretest_warmup_steps: int = flag(
        2, "--pretest_warmup_steps", help="Pretests: untimed steps per arm (compilation, capture)."
    )
    pretest_steps: int = flag(4, "--pretest_steps", help="Pretests: timed steps per arm.")


#: The sections, in the order of TrainConfig's attributes and of the commands' options.
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "optim": OptimOptions,
    "data": DataOptions,
    "runtime": RuntimeOptions,
    "optimizations": OptimizationOptions,
}
