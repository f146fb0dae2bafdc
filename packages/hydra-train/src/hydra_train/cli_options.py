"""Options shared by ``hydra-train run`` and ``hydra-train pretest``: the model, batch and device
options both take, and the SafeOptimizations flags.

Each flag takes the seeds' underscore spelling and Typer's kebab-case (``opt`` from cli_support);
booleans that default on also take ``--no-...`` in both spellings (``--no-experimental_fa3``,
``--no-experimental-fa3``). No ``from __future__ import annotations`` here: Typer reads these
annotations at run time.
"""

from typing import Annotated, Any

import typer

from hydra_kernels.cli_support import AssignmentError, fail, opt, parse_assignments


def switch(name: str, help: str):
    """A boolean flag with its ``--no-`` form, in both spellings."""
    kebab = name.replace("_", "-")
    return typer.Option(f"--{kebab}/--no-{kebab}", f"--{name}/--no-{name}", help=help)


def parse_model_overrides(items: list[str] | None) -> dict[str, Any]:
    """``--model_override FIELD=VALUE`` items as a dict; an item without ``=`` is a usage error."""
    try:
        return parse_assignments(items)
    except AssignmentError as exc:
        fail(f"--model_override {exc.item!r}: expected FIELD=VALUE, e.g. dim=128", code=2)


# --- the model, batch and device options of both commands -----------------------------------------
Arch = Annotated[
    str,
    opt(
        "--arch",
        metavar="hydra|gpt",
        help="Architecture: hydra (CCGQA + MoD/MoR routing) or gpt (the dense baseline: unique "
        "pre-norm layers, GQA, SwiGLU, RoPE; presets of the same sizes).",
    ),
]
ModelSize = Annotated[
    str,
    opt(
        "--model_size",
        metavar="SIZE",
        help="Model preset: tiny, debug, 100M, 250M, 500M, 1B, or auto (tiny on CPU; by GPU memory on CUDA).",
    ),
]
BatchSize = Annotated[int | None, opt("--batch_size", help="Sequences per micro-batch per GPU/process.")]
SeqLen = Annotated[
    int | None, opt("--seq_len", help="Tokens per sequence (row-shaped data fixes it itself).")
]
GradAccum = Annotated[int, opt("--grad_accum", help="Micro-batches accumulated per optimizer step.")]
Lr = Annotated[
    float | None, opt("--lr", help="Peak learning rate (default by preset: tiny 3e-3 ... 1B 3e-4).")
]
Precision = Annotated[
    str,
    opt(
        "--precision",
        metavar="auto|bf16|fp32",
        help="auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32.",
    ),
]
Device = Annotated[str, opt("--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:N.")]
Seed = Annotated[int, opt("--seed", help="Seed for initialisation and data order.")]
VocabSize = Annotated[
    int | None,
    opt(
        "--vocab_size",
        help="Vocabulary size (embedded corpus: of the BPE built for it; 4096 on CPU, 32000 on GPU).",
    ),
]
Moe = Annotated[bool, opt("--moe", help="Mixture-of-Experts FFNs instead of the dense MLP.")]
StaticRouting = Annotated[
    bool,
    opt(
        "--static_routing_mode",
        help="Soft routing: every token through every block (fixed shapes, CUDA-graph friendly).",
    ),
]
ChunkedCe = Annotated[
    bool | None,
    switch(
        "chunked_ce",
        "Loss via hydra_kernels.linear_cross_entropy: no full [tokens, vocab] logits "
        "(default: on with CUDA, off on the CPU).",
    ),
]
CheckpointEvery = Annotated[
    int,
    opt(
        "--checkpoint_every",
        help="Activation checkpointing every N blocks (0: off). Saves memory, costs a recompute.",
    ),
]
TritonKernels = Annotated[
    bool | None,
    switch(
        "triton_kernels",
        "hydra-kernels' fused Triton ops, otherwise the PyTorch references (default: on with "
        "CUDA, pretested by SafeOptimizations; off on the CPU).",
    ),
]
Compile = Annotated[bool, opt("--compile", help="torch.compile the model.")]
EightBitAdam = Annotated[
    bool,
    opt(
        "--8bit_adam",
        help="bitsandbytes AdamW8bit; with a message, fused AdamW when bitsandbytes is missing or unusable.",
    ),
]
PrefetchThreads = Annotated[
    int,
    opt("--experimental_prefetch_threads", help="Threads building batches ahead of the trainer (0: inline)."),
]
ModelOverride = Annotated[
    list[str] | None,
    opt("--model_override", help="Set any HydraConfig field, FIELD=VALUE (repeatable), e.g. dim=128."),
]
CheckpointDir = Annotated[
    str, opt("--checkpoint_dir", help="Where checkpoints, training.db and run artifacts go.")
]
CpuThreads = Annotated[
    int | None,
    opt(
        "--cpu_threads",
        help="CPU training: intra-op threads (default: the cores the load average leaves idle).",
    ),
]

# --- SafeOptimizations ----------------------------------------------------------------------------
SafeFa3 = Annotated[
    bool,
    switch(
        "experimental_fa3",
        "Fastest attention kernel: flash-attn 3/2 when installed, else the fastest SDPA kernel measured "
        "for the shapes (pretested; off: PyTorch's own SDPA choice).",
    ),
]
SafeCudaGraphs = Annotated[
    bool,
    switch(
        "experimental_cuda_graphs",
        "Capture the whole training step as a CUDA graph after --cuda_graphs_warmup steps and replay it "
        "(pretested in the routing mode used).",
    ),
]
GraphWarmup = Annotated[int, opt("--cuda_graphs_warmup", help="Eager steps before the CUDA-graph capture.")]
SafeBlackwell = Annotated[
    bool,
    switch(
        "experimental_blackwell_tuning",
        "hydra-kernels' Blackwell launch table on sm_100/sm_120 (N/A elsewhere).",
    ),
]
BlockQ = Annotated[int | None, opt("--triton_block_q", help="Blackwell tuning: Triton BLOCK_Q override.")]
BlockKV = Annotated[int | None, opt("--triton_block_kv", help="Blackwell tuning: Triton BLOCK_KV override.")]
NumWarps = Annotated[
    int | None, opt("--triton_num_warps", help="Blackwell tuning: Triton num_warps override.")
]
SafeFp8 = Annotated[
    bool,
    switch(
        "experimental_fp8",
        "FP8 GEMMs in the forward of the model's linear layers (sm_89+; bf16 backward and master weights).",
    ),
]
Fp8Format = Annotated[
    str, opt("--fp8_format", metavar="e4m3|e5m2", help="FP8 format of the forward GEMMs: e4m3 or e5m2.")
]
Fp8Scaling = Annotated[
    str,
    opt(
        "--fp8_scaling", metavar="row|tensor", help="FP8 scales: row (per token / output channel) or tensor."
    ),
]
CompileScope = Annotated[
    str,
    opt(
        "--compile_scope",
        metavar="blocks|model",
        help="--compile: blocks (each MoD/MoR block, shared code) or model (whole forward).",
    ),
]
SafetyWindow = Annotated[
    int,
    opt(
        "--experimental_safety_window",
        help="Steps an enabled optimization is watched; 3 anomalies in it disable it.",
    ),
]
SpikeThreshold = Annotated[
    float, opt("--experimental_loss_spike_threshold", help="Loss spike: loss > this × its rolling EMA.")
]
DropThreshold = Annotated[
    float,
    opt(
        "--experimental_throughput_drop_threshold", help="Throughput drop: tokens/s < this × its rolling EMA."
    ),
]
SkipPretest = Annotated[
    bool,
    opt("--experimental_skip_pretest", help="Enable the requested optimizations without pretests (risky)."),
]
PretestWarmup = Annotated[
    int, opt("--pretest_warmup_steps", help="Pretests: untimed steps per arm (compilation, capture).")
]
PretestSteps = Annotated[int, opt("--pretest_steps", help="Pretests: timed steps per arm.")]

MaxSkippedSteps = Annotated[
    int,
    opt(
        "--max_skipped_steps",
        help="Stop the run as failed once more than N optimizer steps in a row are skipped for "
        "non-finite loss or gradients.",
    ),
]
Debug = Annotated[bool, opt("--debug", help="On an error, show the full traceback, not one line.")]
