"""The seed's diagnostics list, by name: which command each tool is, whether it needs CUDA, and the
library function behind it. ``list_tools()`` and ``run_tool(name, **kwargs)`` are the Python face;
``python -m hydra_diag <tool> [options]`` runs the tool's command.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hydra_diag.output import DiagError


@dataclass(frozen=True)
class Tool:
    name: str
    command: tuple[str, ...]
    needs_cuda: bool
    description: str
    function: str  # "module:function" of the library entry point

    def call(self, **kwargs: Any) -> dict[str, Any]:
        module, func = self.function.split(":")
        return getattr(importlib.import_module(f"hydra_diag.{module}"), func)(**kwargs)


TOOLS: tuple[Tool, ...] = (
    Tool(
        "benchmark_hydra_models",
        ("bench", "model"),
        True,
        "full-model training step: tokens/s, MFU on executed FLOPs, peak memory",
        "model_bench:bench_model",
    ),
    Tool(
        "benchmark_performance",
        ("bench", "performance"),
        True,
        "the comprehensive suite: ceilings, kernels, attention backends, model",
        "perf_suite:performance_suite",
    ),
    Tool(
        "benchmark_kernels",
        ("bench", "kernels"),
        True,
        "forward pass of every fused op against eager, torch.compile and Liger",
        "kernel_bench:bench_kernels_forward",
    ),
    Tool(
        "benchmark_backward_kernels",
        ("bench", "backward-kernels"),
        True,
        "SwiGLU, RMSNorm, QK-norm backward: ms, GB/s, % of copy bandwidth",
        "kernel_bench:bench_backward_kernels",
    ),
    Tool(
        "benchmark_swiglu_backward",
        ("bench", "swiglu-backward"),
        True,
        "SwiGLU backward across shapes and dtypes",
        "kernel_bench:bench_swiglu_backward",
    ),
    Tool(
        "tall_skinny_bench",
        ("bench", "tall-skinny"),
        True,
        "matmul throughput of tall/skinny shapes",
        "matmul_bench:tall_skinny_bench",
    ),
    Tool(
        "throughput_sweep",
        ("sweep", "throughput"),
        True,
        "tokens/s and memory over batch size × sequence length",
        "model_bench:throughput_sweep",
    ),
    Tool(
        "seq_len_vram_sweep",
        ("sweep", "vram"),
        True,
        "peak memory against sequence length; the longest that fits",
        "model_bench:vram_sweep",
    ),
    Tool(
        "sweep_training_knobs",
        ("sweep", "knobs"),
        False,
        "short training runs over hyperparameter values",
        "knobs:sweep_knobs",
    ),
    Tool(
        "profile_kernels",
        ("profile", "kernels"),
        True,
        "torch.profiler: top GPU kernels of a training step, Chrome trace",
        "profiling:profile_kernels",
    ),
    Tool(
        "profile_python_overhead",
        ("profile", "python-overhead"),
        True,
        "CPU time vs GPU time per training step",
        "profiling:python_overhead",
    ),
    Tool(
        "model_health_check",
        ("health", "model"),
        False,
        "parameter counts, init statistics, finite fwd/bwd, initial loss ≈ ln V, causality",
        "health:model_health_check",
    ),
    Tool(
        "routing_healthcheck",
        ("health", "routing"),
        False,
        "MoD/MoR/MoE routing statistics and router collapse detection",
        "routing_health:routing_health",
    ),
    Tool(
        "eval_checkpoint",
        ("eval", "checkpoint"),
        False,
        "validation loss and perplexity of a checkpoint (CUDA when present)",
        "evaluation:eval_checkpoint",
    ),
    Tool(
        "eval_sanity_diagnostic",
        ("eval", "sanity"),
        False,
        "overfit one batch; a short run's loss must fall",
        "evaluation:eval_sanity",
    ),
    Tool(
        "deep_diagnosis",
        ("analyze", "deep-diagnosis"),
        False,
        "per-layer gradient and activation norms; dead or exploding layers",
        "deep_diagnosis:deep_diagnosis",
    ),
    Tool(
        "loss_component_diagnostic",
        ("analyze", "loss-components"),
        False,
        "CE and auxiliary loss terms over a run (metrics DB)",
        "loss_components:analyze_loss_components",
    ),
    Tool(
        "diagnose_learning",
        ("analyze", "learning"),
        False,
        "warmup, spikes, plateaus, clipping of a run (metrics DB)",
        "learning:analyze_learning",
    ),
    Tool(
        "scaling_analysis",
        ("analyze", "scaling"),
        False,
        "train several sizes, fit power laws, predict a 4B model",
        "scaling:scaling_analysis",
    ),
    Tool(
        "moe_specialization",
        ("moe", "specialization"),
        False,
        "per-expert token statistics (inference) or weight similarity (weights)",
        "moe_analysis:specialization_inference",
    ),
    Tool(
        "moe_watchdog",
        ("moe", "watchdog"),
        False,
        "follow a run and flag collapsing or dead experts",
        "watchdog:watch_run",
    ),
    Tool(
        "moe_weight_balance",
        ("moe", "weight-balance"),
        False,
        "per-expert weight norms of a checkpoint",
        "moe_analysis:weight_balance",
    ),
    Tool(
        "convert_nemotron_jsonl_to_pt",
        ("convert", "jsonl-to-pt"),
        False,
        "JSONL text → tokenized .pt shards",
        "convert:jsonl_to_pt",
    ),
    Tool(
        "convert_small_chat_to_pt",
        ("convert", "chat-to-pt"),
        False,
        "chat JSONL (roles) → tokenized .pt shards",
        "convert:chat_to_pt",
    ),
    Tool(
        "collect_pt_by_seq",
        ("convert", "collect-by-seq"),
        False,
        "regroup .pt shards by sequence length",
        "collect_by_seq:collect_by_seq",
    ),
)

_BY_NAME = {t.name: t for t in TOOLS}


def get_tool(name: str) -> Tool:
    """The tool of that name (the seed's script name, with or without ``.py``)."""
    key = name.removesuffix(".py").replace("-", "_")
    if key not in _BY_NAME:
        raise DiagError(f"unknown tool {name!r}; tools: {', '.join(_BY_NAME)}")
    return _BY_NAME[key]


def list_tools() -> list[dict[str, Any]]:
    """Every tool: name, the ``hydra-diag`` command, whether it needs CUDA, one-line description."""
    return [
        {
            "name": t.name,
            "command": "hydra-diag " + " ".join(t.command),
            "needs_cuda": t.needs_cuda,
            "description": t.description,
        }
        for t in TOOLS
    ]


def run_tool(name: str, **kwargs: Any) -> dict[str, Any]:
    """Run a tool's library function with ``kwargs`` (its parameters) and return its result dict.
    A CUDA-only tool on a machine without CUDA raises :class:`DiagError` with one clear line."""
    tool = get_tool(name)
    if tool.needs_cuda:
        import torch

        if not torch.cuda.is_available() and not kwargs.get("device"):
            raise DiagError(
                f"{tool.name} needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False)."
            )
    return tool.call(**kwargs)


def tool_argv(name: str, args: list[str]) -> list[str]:
    """The ``hydra-diag`` argv that runs tool ``name`` with the remaining ``args``."""
    tool = get_tool(name)
    return [*tool.command, *args]
