"""The optimizations section of a run's configuration (:class:`OptimizationOptions`: what
SafeOptimizations is asked for) and the planned-token thresholds from which a CUDA run compiles by
default. Re-exported by :mod:`hydra_train.config_options`, which holds the other sections."""

from __future__ import annotations

from dataclasses import dataclass

from hydra_train.config_fields import RUN, flag

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
    #: None = on for a long run with CUDA (compile_defaults.compile_by_default)
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
