"""``hydra-diag bench``: kernel, model, inference and suite benchmarks (CUDA; inference runs on
CPU too)."""

from typing import Annotated

from hydra_diag.cliutil import JsonOut, ModelSize, NoPlot, Overrides, PlotPath, default_plot, execute, opt
from hydra_kernels.cli_support import new_app, require_cuda

app = new_app("GPU benchmarks of the fused kernels, the model and the whole suite (CUDA only).")

Ops = Annotated[list[str] | None, opt("--op", help="Only this op (repeatable).")]
Tokens = Annotated[int, opt("--tokens", help="Rows (tokens) of the row-wise ops.", min=1)]
Rep = Annotated[int, opt("--rep", help="do_bench measuring time per implementation (ms).", min=5)]
NoCompile = Annotated[bool, opt("--no_compile", help="Skip the torch.compile peers (faster).")]
Dtype = Annotated[str, opt("--dtype", metavar="bf16|fp16|fp32", help="bf16, fp16 or fp32.")]
Steps = Annotated[int, opt("--steps", help="Timed training steps.", min=1)]
BatchSize = Annotated[int, opt("--batch_size", help="Sequences per step.", min=1)]
SeqLen = Annotated[int, opt("--seq_len", help="Tokens per sequence.", min=2)]
PeakTflops = Annotated[
    float | None, opt("--peak_tflops", help="Device peak for MFU (default: datasheet bf16).")
]


def _dtype(name: str):
    import torch

    from hydra_diag.output import DiagError

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise DiagError(f"--dtype {name!r}: use bf16, fp16 or fp32")
    return table[name]


@app.command("kernels")
def kernels_cmd(
    ops: Ops = None,
    tokens: Tokens = 16384,
    dtype: Dtype = "bf16",
    no_compile: NoCompile = False,
    rep: Rep = 50,
    json_out: JsonOut = False,
) -> None:
    """Forward pass of every fused op (RMSNorm, fused add+RMSNorm, SwiGLU, QK-norm, RoPE, linear+CE)
    against torch eager, torch.compile and Liger-Kernel when importable: median ms, GB/s over the byte
    floor, % of the measured copy bandwidth (TFLOP/s for linear+CE). Needs CUDA."""
    require_cuda("hydra-diag bench kernels")
    from hydra_diag.kernel_bench import bench_kernels_forward, render_kernel_rows

    execute(
        "bench kernels",
        lambda say: bench_kernels_forward(
            ops, tokens=tokens, dtype=_dtype(dtype), compile_peers=not no_compile, rep=rep, progress=say
        ),
        json_out,
        render_kernel_rows,
    )


@app.command("backward-kernels")
def backward_kernels_cmd(
    ops: Ops = None,
    tokens: Tokens = 16384,
    dtype: Dtype = "bf16",
    no_compile: NoCompile = False,
    rep: Rep = 50,
    json_out: JsonOut = False,
) -> None:
    """Backward pass alone of the fused SwiGLU, RMSNorm and QK-norm kernels against PyTorch's backward
    of the same fused forward, torch eager, torch.compile and Liger: median ms, GB/s over the byte floor
    and % of the measured copy bandwidth. Needs CUDA."""
    require_cuda("hydra-diag bench backward-kernels")
    from hydra_diag.kernel_bench import bench_backward_kernels, render_kernel_rows

    execute(
        "bench backward-kernels",
        lambda say: bench_backward_kernels(
            ops, tokens=tokens, dtype=_dtype(dtype), compile_peers=not no_compile, rep=rep, progress=say
        ),
        json_out,
        render_kernel_rows,
    )


@app.command("swiglu-backward")
def swiglu_backward_cmd(
    tokens: Annotated[
        list[int] | None,
        opt("--tokens", help="Row counts (repeatable; default 2048, 8192, 16384, 32768).", min=1),
    ] = None,
    widths: Annotated[
        list[int] | None,
        opt("--width", help="Hidden widths (repeatable; default 1408, 2048, 2730, 5440, 10880).", min=1),
    ] = None,
    dtypes: Annotated[
        list[str] | None, opt("--dtype", help="bf16, fp16 or fp32 (repeatable; default bf16).")
    ] = None,
    rep: Rep = 30,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """SwiGLU backward across shapes (odd widths included) and dtypes: the fused kernel, the fused
    forward with PyTorch's backward, torch eager and the packed [N, 2H] layout; ms, GB/s, % of copy
    bandwidth and the launch configuration in use. Needs CUDA. PNG: GB/s against bytes moved."""
    require_cuda("hydra-diag bench swiglu-backward")
    from hydra_diag.kernel_bench import bench_swiglu_backward, render_kernel_rows
    from hydra_diag.plots_gpu import plot_swiglu_backward

    kw = {}
    if tokens:
        kw["tokens"] = tuple(tokens)
    if widths:
        kw["widths"] = tuple(widths)
    execute(
        "bench swiglu-backward",
        lambda say: bench_swiglu_backward(
            dtypes=tuple(_dtype(d) for d in (dtypes or ["bf16"])), rep=rep, progress=say, **kw
        ),
        json_out,
        render_kernel_rows,
        plot=plot_swiglu_backward,
        plot_path=default_plot(plot, no_plot, "swiglu_backward"),
    )


@app.command("model")
def model_cmd(
    model_size: ModelSize = "100M",
    configs: Annotated[
        list[str] | None,
        opt("--config", help="dynamic, static or dense (repeatable; default: all three)."),
    ] = None,
    modes: Annotated[
        list[str] | None, opt("--mode", help="eager or compile (repeatable; default eager).")
    ] = None,
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 2048,
    steps: Steps = 10,
    warmup: Annotated[
        int, opt("--warmup", help="Untimed steps first (compilation happens here).", min=1)
    ] = 3,
    chunked_ce: Annotated[
        bool, opt("--chunked_ce/--no_chunked_ce", help="Loss without \\[tokens, vocab] logits.")
    ] = True,
    checkpoint_every: Annotated[
        int, opt("--checkpoint_every", help="Activation checkpointing every N blocks.")
    ] = 0,
    compile_scope: Annotated[
        str,
        opt(
            "--compile_scope", metavar="blocks|model", help="blocks (shared block, dynamic shapes) or model."
        ),
    ] = "blocks",
    overrides: Overrides = None,
    peak_tflops: PeakTflops = None,
    json_out: JsonOut = False,
) -> None:
    """Full-model training step (bf16 autocast, fused AdamW, random tokens): tokens/s, MFU on the
    FLOPs the routed model actually executes, peak memory, for the dynamic / static-routing / dense
    configurations, eager or compiled. Needs CUDA."""
    require_cuda("hydra-diag bench model")
    from hydra_diag.model_bench import bench_model, render_bench_model

    execute(
        "bench model",
        lambda say: bench_model(
            model_size,
            tuple(configs or ("dynamic", "static", "dense")),
            tuple(modes or ("eager",)),
            batch_size,
            seq_len,
            steps,
            warmup,
            chunked_ce,
            checkpoint_every,
            compile_scope,
            overrides,
            peak_tflops,
            progress=say,
        ),
        json_out,
        render_bench_model,
    )


@app.command("inference")
def inference_cmd(
    model_size: ModelSize = "100M",
    configs: Annotated[
        str, opt("--configs", help="Race configurations, comma-separated (hydra-diag race --help).")
    ] = "gpt,hydra",
    sets: Annotated[
        list[str] | None, opt("--set", help="CONFIG.FIELD=VALUE override, as in hydra-diag race.")
    ] = None,
    prompt_len: Annotated[int, opt("--prompt_len", help="Prompt tokens.", min=1)] = 64,
    new_tokens: Annotated[int, opt("--new_tokens", help="Tokens generated per run.", min=1)] = 128,
    batch_size: BatchSize = 1,
    flops_seq_len: Annotated[
        int, opt("--flops_seq_len", help="Sequence length of the counted eval forward.", min=2)
    ] = 2048,
    device: Annotated[str, opt("--device", metavar="cuda|cpu", help="cuda (bf16) or cpu (fp32).")] = "cuda",
    repeats: Annotated[int, opt("--repeats", help="Timed generations (median).", min=1)] = 3,
    decode: Annotated[
        str,
        opt(
            "--decode",
            metavar="MODES",
            help="Decode modes to time, comma-separated: auto (CUDA graphs on CUDA), eager, staged, "
            "graphs, masked (every routed block run, its update masked: one graph without "
            "conditional nodes).",
        ),
    ] = "eager,auto",
    json_out: JsonOut = False,
) -> None:
    """Inference cost per configuration: parameters, the FLOPs one inference-mode forward
    executes per token (counted with torch's FlopCounterMode on fake tensors, so routed models
    count only the rows they gather), and greedy generation tokens/s (median of --repeats after
    a warm-up). Runs on CPU too (tiny sizes; timings then say little)."""
    if device.startswith("cuda"):
        import torch

        from hydra_kernels.cli_support import fail

        if not torch.cuda.is_available():  # the CPU works too: say how to get there
            fail(
                f"hydra-diag bench inference --device {device} needs a CUDA GPU and none is visible here; "
                "pass --device cpu (fp32; a small --model-size such as tiny)"
            )
    from hydra_diag.inference_bench import bench_inference, render_inference

    execute(
        "bench inference",
        lambda say: bench_inference(
            model_size,
            [c.strip() for c in configs.split(",") if c.strip()],
            sets,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            batch_size=batch_size,
            flops_seq_len=flops_seq_len,
            device=device,
            repeats=repeats,
            decodes=tuple(m.strip() for m in decode.split(",") if m.strip()),
            progress=say,
        ),
        json_out,
        render_inference,
    )


@app.command("performance")
def performance_cmd(
    model_size: ModelSize = "100M",
    batch_size: BatchSize = 8,
    seq_len: SeqLen = 2048,
    steps: Steps = 8,
    rep: Rep = 50,
    json_out: JsonOut = False,
) -> None:
    """The comprehensive suite: copy-bandwidth and matmul ceilings, every kernel (fwd+bwd, reference vs
    fused), causal attention through each backend (flexible_attention's and SDPA's kernels), and the
    model's training step (dynamic and dense). Needs CUDA."""
    require_cuda("hydra-diag bench performance")
    from hydra_diag.perf_suite import performance_suite, render_performance

    execute(
        "bench performance",
        lambda say: performance_suite(model_size, batch_size, seq_len, steps, rep, progress=say),
        json_out,
        render_performance,
    )


@app.command("tall-skinny")
def tall_skinny_cmd(
    m: Annotated[
        list[int] | None, opt("--m", help="Rows M (repeatable; default 4096, 16384, 65536).", min=1)
    ] = None,
    k: Annotated[
        list[int] | None, opt("--k", help="Inner size K (repeatable; default 768, 2048).", min=1)
    ] = None,
    n: Annotated[
        list[int] | None,
        opt("--n", help="Output columns N (repeatable; default 1, 4, 16, 64, 128, 256, 512, 1024).", min=1),
    ] = None,
    dtype: Dtype = "bf16",
    rep: Rep = 30,
    plot: PlotPath = None,
    no_plot: NoPlot = False,
    json_out: JsonOut = False,
) -> None:
    """Matmul throughput of tall/skinny shapes [M, K] @ [K, N] (routers, latent projections): ms,
    TFLOP/s against a measured square matmul, GB/s against the copy bandwidth, and whether the shape is
    memory- or compute-bound. Needs CUDA. PNG: TFLOP/s and GB/s against N."""
    require_cuda("hydra-diag bench tall-skinny")
    from hydra_diag.matmul_bench import render_tall_skinny, tall_skinny_bench
    from hydra_diag.plots_gpu import plot_tall_skinny

    kw = {}
    for key, val in (("rows_m", m), ("inner_k", k), ("outer_n", n)):
        if val:
            kw[key] = tuple(val)
    execute(
        "bench tall-skinny",
        lambda say: tall_skinny_bench(dtype=_dtype(dtype), rep=rep, progress=say, **kw),
        json_out,
        render_tall_skinny,
        plot=plot_tall_skinny,
        plot_path=default_plot(plot, no_plot, "tall_skinny"),
    )
