"""The one timing harness of every kernel benchmark: how a call is timed, which peers stand beside
hydra's op, how one implementation becomes one result row, and how a report is written.

``hydra-kernels bench`` (:mod:`hydra_kernels.bench`: forward+backward against docs/TARGETS.md), the
single-pass benchmarks behind ``hydra-diag bench kernels``/``backward-kernels``/``swiglu-backward``
(:mod:`hydra_kernels.bench_passes`) and the measuring scripts in ``packages/hydra-diag/bench/`` all
time through here, so a figure from one is comparable with a figure from another.

- On CUDA a figure is the median of ``triton.testing.do_bench`` (the L2 cache cleared between
  runs; :func:`time_ms`), optionally a CUDA-graph replay (:func:`graph_ms`: the GPU's time without
  the host's); elsewhere it is a median of wall-clock calls (:func:`wall_timer`), which exists so
  that the same code runs in CPU tests.
- Bandwidth is set against the device-to-device copy bandwidth measured in the same process
  (:func:`copy_bandwidth_tbps`).
- The peers are torch eager and torch.compile of the op's PyTorch reference and Liger-Kernel's op
  when Liger is importable (:func:`peers`); a peer that fails is a row with its error, not a crash.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hydra_kernels import controls

#: A timer: milliseconds of one call of a no-argument function.
Timer = Callable[[Callable[[], Any]], float]

#: The error of a hydra row whose Triton kernel failed while being timed: the reference ran.
FELL_BACK = "the Triton kernel failed and fell back to the reference (not timed fairly)"


# --- timing ------------------------------------------------------------------------------------


def time_ms(step: Callable[[], Any], rep: int = 100) -> float:
    """Median milliseconds of ``step`` on CUDA (do_bench clears the L2 cache between runs)."""
    from triton.testing import do_bench

    step()
    torch.cuda.synchronize()
    return float(do_bench(step, warmup=25, rep=rep, return_mode="median"))


def graph_ms(step: Callable[[], Any], rep: int = 100) -> float | None:
    """Median milliseconds of one replay of ``step`` captured in a CUDA graph: the GPU's time for
    the call (gaps between kernels included) with the host's Python and launch work taken out.
    None when the step cannot be captured."""
    from triton.testing import do_bench

    from hydra_kernels.cuda_graph import CUDAGraphStep

    graphed = CUDAGraphStep.deferred(step)
    graphed.warm_up(2)  # off the capture: compiles, allocator pools
    try:
        graphed.capture()
    except Exception:
        return None
    try:
        return float(do_bench(graphed.replay, warmup=25, rep=rep, return_mode="median"))
    finally:
        graphed.release()


def wall_timer(repeats: int = 3) -> Timer:
    """Median wall-clock milliseconds over ``repeats`` calls after one untimed call (CPU runs of the
    benchmarks, in tests: the figures say nothing about a GPU)."""

    def timer(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    return timer


def timer_for(device: torch.device, rep: int = 100) -> Timer:
    """:func:`time_ms` with ``rep`` on a CUDA device, :func:`wall_timer` elsewhere."""
    if device.type == "cuda":
        return lambda fn: time_ms(fn, rep=rep)
    return wall_timer()


def peak_extra_mib(step: Callable[[], Any]) -> float:
    """Peak CUDA memory allocated above what was live before one call of ``step``, in MiB."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_bandwidth_tbps(device: torch.device, gib: float = 1.0, timer: Timer | None = None) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) in TB/s, timed by
    ``timer`` (default: :func:`time_ms` over 200 ms)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = (timer or (lambda fn: time_ms(fn, rep=200)))(lambda: dst.copy_(src))
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def environment(device: torch.device) -> dict[str, Any]:
    """What a report records of the machine: device name (and compute capability on CUDA), torch
    and triton versions."""
    env: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    env["torch"] = torch.__version__
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:  # CPU machines without triton: the wall-clock timer needs none
        env["triton"] = None
    return env


def bench_setup(device: torch.device, rep: int) -> tuple[Timer, float | None, dict[str, Any]]:
    """The timer, copy bandwidth (None off CUDA) and environment of a benchmark on ``device``."""
    copy = copy_bandwidth_tbps(device) if device.type == "cuda" else None
    return timer_for(device, rep), copy, {**environment(device), "copy_tbps": copy}


# --- peers -------------------------------------------------------------------------------------


def liger_peers() -> tuple[dict[str, Callable[..., Any]], str | None]:
    """Liger-Kernel's functions by bench op, and its version (or why it is not importable)."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # not installed, or built for another torch/triton
        return {}, f"Liger-Kernel not importable ({type(exc).__name__}: {str(exc)[:120]})"
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False),
        "fused_add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(
            x, r, w, 1e-6, 0.0, "llama", False
        ),
        "swiglu": LigerSiLUMulFunction.apply,
        "linear_ce": LigerFusedLinearCrossEntropyFunction.apply,
    }, importlib.metadata.version("liger-kernel")


def peers(
    op: str,
    ref: Callable[..., Any],
    liger: dict[str, Callable[..., Any]],
    why: str | None,
    with_compile: bool = True,
) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """The implementations timed beside hydra's op: torch eager and (with ``with_compile``)
    torch.compile of the reference, and Liger's op when it has one (else why not, as a note)."""
    impls: dict[str, Callable[..., Any]] = {"eager": ref}
    if with_compile:
        impls["compile"] = torch.compile(ref, dynamic=False)
    notes = {}
    if op in liger:
        impls["liger"] = liger[op]
    else:
        notes["liger"] = why or f"Liger-Kernel has no {op} op with these semantics"
    return impls, notes


# --- inputs, steps and rows ----------------------------------------------------------------------------


def rand_tensor(*shape: int, dev: torch.device, dt: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """A standard-normal tensor times ``scale`` (no gradient)."""
    return torch.randn(*shape, device=dev, dtype=dt) * scale


def private_copy(value: Any, requires_grad: bool | None = None) -> Any:
    """A fresh copy of a benchmark input (tensors, also inside a tuple; anything else as it is),
    requiring gradients as the original does unless ``requires_grad`` says. Some peers (Liger's
    SwiGLU and RMSNorm backward) write their gradients over their saved inputs or the incoming
    gradient, which would otherwise change the data every implementation timed after them sees."""
    if isinstance(value, torch.Tensor):
        grad = value.requires_grad if requires_grad is None else requires_grad
        return value.detach().clone().requires_grad_(grad)
    if isinstance(value, tuple):
        return tuple(private_copy(v, requires_grad) for v in value)
    return value


def fwd_bwd_step(
    fn: Callable[..., Any], inputs: list[Any], grad_out: torch.Tensor | tuple[torch.Tensor, ...] | None
) -> Callable[[], None]:
    """A closure running ``fn(*inputs)`` forward and backward, clearing gradients first. A tuple
    ``grad_out`` goes to the outputs of an op with several (fused add: normed and summed); None
    means the output is a scalar loss."""
    params = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step() -> None:
        for t in params:
            t.grad = None
        out = fn(*inputs)
        if isinstance(grad_out, tuple):
            torch.autograd.backward(out[: len(grad_out)], grad_out)
            return
        if isinstance(out, tuple):  # e.g. Liger's fused CE returns (loss, extras...)
            out = out[0]
        out.backward() if grad_out is None else out.backward(grad_out)

    return step


def backward_step(fn: Callable[..., Any], inputs: list[Any], diff: list[int]) -> Callable[[], Any]:
    """A closure computing only the backward of one fixed forward of ``fn`` (the gradients of the
    inputs at ``diff``, for random output gradients; the graph is kept for the next call)."""
    out = fn(*inputs)
    outs = [
        o
        for o in (out if isinstance(out, tuple) else (out,))
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    grads = [torch.randn_like(o) for o in outs]
    wrt = [inputs[i] for i in diff]
    return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)


def add_rates(row: dict[str, Any], nbytes: float, flops: float, copy_tbps: float | None) -> None:
    """GB/s over the byte floor ``nbytes`` and its share of the copy bandwidth, TFLOP/s over
    ``flops``: added to a row that was timed."""
    if not row.get("ms"):
        return
    if nbytes:
        row["gbps"] = nbytes / (row["ms"] * 1e-3) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / (copy_tbps * 1e3) if copy_tbps else None
    if flops:
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12


def timed_row(
    op: str,
    shape: str,
    impl: str,
    control: str,
    measure: Callable[[dict[str, Any]], float],
    nbytes: float = 0,
    flops: float = 0.0,
    copy_tbps: float | None = None,
) -> dict[str, Any]:
    """One implementation's result row: ``measure(row)`` gives its ms (and may add figures of its
    own to the row) or raises, and the error is recorded; a hydra implementation whose Triton
    kernel (controls op ``control``) fell back to the reference meanwhile is marked as not timed
    fairly. Rates follow (:func:`add_rates`)."""
    row: dict[str, Any] = {"op": op, "shape": shape, "impl": impl, "ms": None}
    before = controls.fallback_counts()[control]
    try:
        row["ms"] = measure(row)
    except Exception as exc:  # a failing peer is a finding, not a crash
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if impl.startswith("hydra") and controls.fallback_counts()[control] > before:
        row["error"] = FELL_BACK
    add_rates(row, nbytes, flops, copy_tbps)
    return row


def note_rows(op: str, shape: str, notes: dict[str, str]) -> list[dict[str, Any]]:
    """Rows of the peers that did not run (e.g. Liger without the op), with why."""
    return [
        {"op": op, "shape": shape, "impl": impl, "ms": None, "note": note} for impl, note in notes.items()
    ]


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write a benchmark report as JSON at ``path`` (folders created; what JSON cannot hold, such
    as a dtype, as its text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
