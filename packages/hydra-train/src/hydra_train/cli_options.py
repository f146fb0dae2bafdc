"""Options shared by ``hydra-train run`` and ``hydra-train pretest``: the SafeOptimizations flags.

Each flag takes the seeds' underscore spelling and Typer's kebab-case; booleans that default on
also take ``--no-...`` in both spellings (``--no-experimental_fa3``, ``--no-experimental-fa3``).
No ``from __future__ import annotations`` here: Typer reads these annotations at run time.
"""

from typing import Annotated

import typer


def opt(*names: str, help: str, **kw):
    """An option under both spellings: the kebab-case one Typer prints first, then the seed's."""
    spellings: list[str] = []
    for n in names:
        for s in (n.replace("_", "-"), n):
            if s not in spellings:
                spellings.append(s)
    return typer.Option(*spellings, help=help, **kw)


def switch(name: str, help: str):
    """A boolean flag with its ``--no-`` form, in both spellings."""
    kebab = name.replace("_", "-")
    return typer.Option(f"--{kebab}/--no-{kebab}", f"--{name}/--no-{name}", help=help)


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
Fp8Format = Annotated[str, opt("--fp8_format", help="FP8 format of the forward GEMMs: e4m3 or e5m2.")]
Fp8Scaling = Annotated[
    str, opt("--fp8_scaling", help="FP8 scales: row (per token / output channel) or tensor.")
]
CompileScope = Annotated[
    str,
    opt(
        "--compile_scope",
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


def safe_opts_config(
    *,
    experimental_fa3: bool,
    experimental_cuda_graphs: bool,
    cuda_graphs_warmup: int,
    experimental_blackwell_tuning: bool,
    triton_block_q: int | None,
    triton_block_kv: int | None,
    triton_num_warps: int | None,
    experimental_fp8: bool,
    fp8_format: str,
    fp8_scaling: str,
    compile_scope: str,
    experimental_safety_window: int,
    experimental_loss_spike_threshold: float,
    experimental_throughput_drop_threshold: float,
    experimental_skip_pretest: bool,
    pretest_warmup_steps: int,
    pretest_steps: int,
) -> dict:
    """The TrainConfig fields of these options (keyword-only, so a caller cannot mix them up)."""
    return dict(locals())
