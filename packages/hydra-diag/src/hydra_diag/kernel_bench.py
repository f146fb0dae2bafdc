"""``bench kernels`` (forward), ``bench backward-kernels`` and ``bench swiglu-backward`` (backward
only): thin callers of :mod:`hydra_kernels.bench_passes`, where kernel benchmarking lives (its
timing, peers and rows are :mod:`hydra_kernels.bench_harness`'s, shared with ``hydra-kernels
bench``). What is hydra-diag's here: a missing GPU or an unknown op is a :class:`DiagError` naming
the command, and the tables.
"""

from __future__ import annotations

from typing import Any

import torch

from hydra_diag.loading import require_cuda_device
from hydra_diag.output import DiagError
from hydra_kernels import bench_passes


def _device(device: str | None, tool: str) -> torch.device:
    return torch.device(device) if device else require_cuda_device(tool)


def _known(ops: list[str] | None) -> list[str] | None:
    """``ops`` as bench_passes names them; hydra-kernels' canonical names and aliases are taken too
    (its check and bench call linear+CE linear_cross_entropy, bench_passes linear_ce)."""
    if ops is None:
        return None
    from hydra_kernels.registry import canonical_op

    by_canonical = {canonical_op(p): p for p in bench_passes.PASS_OPS}
    out = []
    for op in ops:
        name = op if op in bench_passes.PASS_OPS else by_canonical.get(canonical_op(op))
        if name is None:
            raise DiagError(f"unknown op {op!r}; choose from {', '.join(bench_passes.PASS_OPS)}")
        out.append(name)
    return out


def bench_kernels_forward(
    ops: list[str] | None = None, device: str | None = None, **options: Any
) -> dict[str, Any]:
    """Forward-only ms, GB/s and % of copy bandwidth of each op against eager, compile and Liger.
    ``options``: those of :func:`hydra_kernels.bench_passes.bench_pass` (tokens, dims, head_shapes,
    dtype, compile_peers, rep, progress)."""
    dev = _device(device, "bench kernels")
    return bench_passes.bench_pass(False, _known(ops), device=dev, **options)


def bench_backward_kernels(
    ops: list[str] | None = None, device: str | None = None, **options: Any
) -> dict[str, Any]:
    """Backward-only ms, GB/s and % of copy bandwidth for SwiGLU, RMSNorm and QK-norm (``options``
    as :func:`bench_kernels_forward`'s)."""
    dev = _device(device, "bench backward-kernels")
    return bench_passes.bench_pass(True, _known(ops), device=dev, **options)


def bench_swiglu_backward(device: str | None = None, **options: Any) -> dict[str, Any]:
    """SwiGLU backward across shapes and dtypes: fused, PyTorch backward, eager, packed layout
    (``options``: those of :func:`hydra_kernels.bench_passes.bench_swiglu_backward`)."""
    dev = _device(device, "bench swiglu-backward")
    return bench_passes.bench_swiglu_backward(device=dev, **options)


def render_kernel_rows(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    title = (
        f"{result['tool']} on {result['device']} ({result.get('dtype', '')}, "
        f"copy {result.get('copy_tbps')} TB/s)"
    )
    cols = ["op", "shape", "impl", "ms", "gbps", "pct_copy", "tflops", "error", "note"]
    if result["tool"] == "benchmark_swiglu_backward":
        cols = ["dtype", "shape", "impl", "ms", "gbps", "pct_copy", "error"]
    present = [c for c in cols if any(r.get(c) is not None for r in result["rows"])]
    console.print(rows_table(title, result["rows"], present, formats={"pct_copy": ".1f", "gbps": ".0f"}))
    if result.get("summary"):
        console.print(
            rows_table(
                "summary: hydra against its fastest peer",
                result["summary"],
                formats={"pct_copy": ".1f", "gbps": ".0f", "speedup_vs_best_peer": ".2f"},
            )
        )
