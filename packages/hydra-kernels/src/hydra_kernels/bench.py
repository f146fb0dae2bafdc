"""Benchmarks of the fused ops against torch eager, torch.compile and Liger-Kernel (CUDA only).

Every figure is forward+backward, the median of ``triton.testing.do_bench`` on random inputs.
Bandwidth counts the byte floor of docs/TARGETS.md (each input read once and each output written once,
over forward and backward) and is set against the device-to-device copy bandwidth measured at the
start of the run. linear+CE is compute-bound: it reports TFLOP/s (6·N·D·V) and the peak memory
allocated above its inputs during one call.

:func:`run_bench` is what ``hydra-kernels bench`` runs; :func:`benchmark_kernels` and
:func:`print_benchmark_results` are the small Python-level face.
"""

import importlib.metadata
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import (
    clear_launch_overrides,
    resolve_launch_config,
    set_launch_overrides,
)
from hydra_kernels.ops.linear_cross_entropy import linear_cross_entropy
from hydra_kernels.registry import OP_SPECS, OPS_BY_NAME
from hydra_kernels.registry import PRESET_HEAD_SHAPES as PRESET_HEAD_SHAPES  # kept importable here

#: Bench ops (``--op`` values) and the controls op each one exercises (hydra_kernels.registry).
BENCH_OPS: dict[str, str] = {name: spec.name for spec in OP_SPECS for name in spec.bench}
#: Where docs/TARGETS.md's bandwidth target applies: calls that move at least this many bytes.
BANDWIDTH_TARGET_BYTES = 64 * 2**20
BANDWIDTH_TARGET_FRACTION = 0.8
#: Launch configurations ``--sweep`` tries, for the ops whose registry entry has a sweep.
SWEEP_CONFIGS: dict[str, list[dict[str, int]]] = {s.name: list(s.sweep) for s in OP_SPECS if s.sweep}
#: Tokens of the row-wise workloads.
TOKENS = 16384
#: Implementations also timed as a CUDA-graph replay (``graph_ms``: GPU time without host work).
GRAPH_IMPLS = ("hydra", "compile")


@dataclass
class Workload:
    """One op at one shape: the inputs, the implementations to time and the byte/FLOP floor."""

    op: str
    shape: str
    inputs: list[Any]
    grad_out: torch.Tensor | tuple[torch.Tensor, ...] | None  # None: the output is a scalar loss
    impls: dict[str, Callable[..., Any]]
    notes: dict[str, str] = field(default_factory=dict)  # impl -> why it is not timed
    bytes_floor: int = 0
    flops: float = 0.0
    measure_memory: bool = False


# --- peers -----------------------------------------------------------------------------------


def liger_peers() -> tuple[dict[str, Callable[..., Any]], str | None]:
    """Liger-Kernel's functions by op, and its version (or why it is not importable)."""
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


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=False)


def peers(op: str, ref: Callable[..., Any], liger: dict[str, Callable[..., Any]], why: str | None):
    """The peers timed beside hydra: torch eager and torch.compile of the reference, and Liger's
    op when it has one (else why not, as a note)."""
    impls = {"eager": ref, "compile": _compiled(ref)}
    notes = {}
    if op in liger:
        impls["liger"] = liger[op]
    else:
        notes["liger"] = why or f"Liger-Kernel has no {op} op with these semantics"
    return impls, notes


# --- workloads -------------------------------------------------------------------------------

#: linear+CE dW schemes timed beside the default (``dw_accum``): see ops/_linear_ce_chunks.
LINEAR_CE_MODES = ("compensated", "slab", "input")


def with_dw_accum(mode: str) -> Callable[..., Any]:
    """linear_cross_entropy with ``dw_accum=mode`` (the option is read when the call is made)."""
    from hydra_kernels.ops.linear_cross_entropy import reset_linear_ce_options, set_linear_ce_options

    def call(*args: Any) -> Any:
        set_linear_ce_options(dw_accum=mode)
        try:
            return linear_cross_entropy(*args)
        finally:
            reset_linear_ce_options()

    return call


def _randn(*shape: int, dev: torch.device, dt: torch.dtype, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=dt).requires_grad_(grad)


def _workloads(op: str, dev: torch.device, dt: torch.dtype, liger, why) -> Iterator[Workload]:
    """The workloads of bench op ``op`` (its registry entry's generator)."""
    if op not in BENCH_OPS:
        raise ValueError(f"unknown bench op {op!r}; expected one of {', '.join(BENCH_OPS)}")
    yield from OPS_BY_NAME[BENCH_OPS[op]].bench[op](dev, dt, liger, why)


# --- measurement -----------------------------------------------------------------------------


def fwd_bwd_step(
    fn: Callable[..., Any], inputs: list[Any], grad_out: torch.Tensor | tuple[torch.Tensor, ...] | None
):
    """A closure running ``fn(*inputs)`` forward and backward, clearing gradients first. A tuple
    ``grad_out`` goes to the outputs of an op with several (fused add: normed and summed)."""
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


def time_ms(step: Callable[[], None], rep: int = 100) -> float:
    """Median milliseconds of ``step`` (do_bench clears the L2 cache between runs)."""
    from triton.testing import do_bench

    step()
    torch.cuda.synchronize()
    return float(do_bench(step, warmup=25, rep=rep, return_mode="median"))


def graph_ms(step: Callable[[], None], rep: int = 100) -> float | None:
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


def peak_extra_mib(step: Callable[[], None]) -> float:
    """Peak memory allocated above what was live before one call of ``step``, in MiB."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_bandwidth_tbps(device: torch.device, gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) in TB/s."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep=200)
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def _private_copy(value: Any) -> Any:
    """A fresh copy of a benchmark input: some peers (Liger's SwiGLU and RMSNorm backward) write
    their gradients over their saved inputs or the incoming gradient, which would otherwise change
    the data every implementation timed after them sees."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_private_copy(v) for v in value)
    return value


def _measure(w: Workload, copy_tbps: float, rep: int) -> list[dict[str, Any]]:
    rows = []
    for impl, fn in w.impls.items():
        row: dict[str, Any] = {"op": w.op, "shape": w.shape, "impl": impl, "ms": None}
        before = controls.fallback_counts()[BENCH_OPS[w.op]]
        try:
            inputs = [_private_copy(t) for t in w.inputs]
            step = fwd_bwd_step(fn, inputs, _private_copy(w.grad_out))
            if w.measure_memory:
                row["peak_extra_mib"] = round(peak_extra_mib(step), 1)
            row["ms"] = time_ms(step, rep)
            if impl in GRAPH_IMPLS and not w.measure_memory:
                row["graph_ms"] = graph_ms(step, rep)
        except Exception as exc:  # a failing peer is a finding, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if impl == "hydra" and controls.fallback_counts()[BENCH_OPS[w.op]] > before:
            row["error"] = "the Triton kernel failed and fell back to the reference (not timed fairly)"
        if row["ms"]:
            if w.bytes_floor:
                row["gbps"] = w.bytes_floor / (row["ms"] * 1e-3) / 1e9
                row["pct_copy"] = 100 * row["gbps"] / (copy_tbps * 1e3)
            if w.flops:
                row["tflops"] = w.flops / (row["ms"] * 1e-3) / 1e12
        rows.append(row)
    for impl, note in w.notes.items():
        rows.append({"op": w.op, "shape": w.shape, "impl": impl, "ms": None, "note": note})
    return rows


def summarize(w: Workload, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One line per workload: hydra against its peers and docs/TARGETS.md's targets."""
    by = {r["impl"]: r for r in rows}
    ms = {k: r["ms"] for k, r in by.items() if r.get("ms")}
    hydra = ms.get("hydra")
    peers = {k: v for k, v in ms.items() if k in ("compile", "liger")}
    s: dict[str, Any] = {"op": w.op, "shape": w.shape, "bytes_floor": w.bytes_floor, **ms}
    misses = []
    if hydra is None:
        misses.append("hydra not timed: " + by.get("hydra", {}).get("error", "?"))
    elif peers:
        best = min(peers, key=peers.get)
        s["best_peer"], s["vs_best_peer"] = best, peers[best] / hydra
        if w.op == "linear_ce":
            if hydra > ms.get("compile", math.inf):
                misses.append(f"{hydra / ms['compile']:.2f}x torch.compile's time")
        elif hydra >= peers[best]:
            misses.append(f"{hydra / peers[best]:.2f}x the time of {best}")
    hyd = by.get("hydra", {})
    for key in ("gbps", "pct_copy", "tflops", "peak_extra_mib"):
        if key in hyd:
            s[key] = hyd[key]
    for impl in GRAPH_IMPLS:
        if by.get(impl, {}).get("graph_ms"):
            s[f"{impl}_graph_ms"] = by[impl]["graph_ms"]
    if s.get("hydra_graph_ms") and w.bytes_floor and hyd.get("pct_copy"):
        s["graph_pct_copy"] = hyd["pct_copy"] * hyd["ms"] / s["hydra_graph_ms"]
    pct = hyd.get("pct_copy")
    if w.bytes_floor >= BANDWIDTH_TARGET_BYTES and pct is not None and pct < 100 * BANDWIDTH_TARGET_FRACTION:
        misses.append(f"{pct:.0f}% of copy bandwidth (< 80%)")
    liger_mib = by.get("liger", {}).get("peak_extra_mib")
    if w.measure_memory and liger_mib is not None and hyd.get("peak_extra_mib", 0) > liger_mib:
        misses.append(f"+{hyd['peak_extra_mib']:.0f} MiB > Liger's +{liger_mib:.0f} MiB")
    s["target"] = "met" if not misses else "MISS: " + "; ".join(misses)
    if w.op == "linear_ce":  # the other dW schemes against the same two targets
        s["modes"] = {}
        for impl, r in by.items():
            if impl.startswith("hydra ") and r.get("ms"):
                mib = r.get("peak_extra_mib")
                time_ok = r["ms"] <= ms.get("compile", math.inf)
                mem_ok = mib is not None and liger_mib is not None and mib <= liger_mib
                s["modes"][impl] = {
                    "ms": r["ms"],
                    "peak_extra_mib": mib,
                    "time_ok": time_ok,
                    "memory_ok": mem_ok,
                }
    return s


def _sweep(w: Workload, rep: int) -> dict[str, Any]:
    """Time the hydra op of ``w`` under each of :data:`SWEEP_CONFIGS` (then the table default)."""
    dev = next(t for t in w.inputs if isinstance(t, torch.Tensor)).device
    spec = OPS_BY_NAME[BENCH_OPS[w.op]]
    default = resolve_launch_config(w.op, dev, spec.function(spec.sweep_table))
    step = fwd_bwd_step(w.impls["hydra"], w.inputs, w.grad_out)
    trials = []
    try:
        for cfg in SWEEP_CONFIGS[w.op]:
            set_launch_overrides(w.op, **cfg)
            try:
                trials.append({**cfg, "ms": time_ms(step, rep=max(20, rep // 2))})
            except Exception as exc:
                trials.append({**cfg, "ms": None, "error": f"{type(exc).__name__}: {exc}"[:200]})
    finally:
        clear_launch_overrides()  # the sweep's overrides; bench runs in a process of its own
    timed = [t for t in trials if t["ms"]]
    return {
        "op": w.op,
        "shape": w.shape,
        "default": {k: getattr(default, k) for k in SWEEP_CONFIGS[w.op][0]},
        "default_ms": time_ms(step, rep=max(20, rep // 2)),
        "best": min(timed, key=lambda t: t["ms"]) if timed else None,
        "trials": trials,
    }


def run_bench(
    ops: list[str] | None = None,
    sweep: bool = False,
    rep: int = 100,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every selected op × shape against its peers; or, with ``sweep``, time only the
    hydra op of each op with a sweep under each launch config of :data:`SWEEP_CONFIGS` (to pick the
    defaults of their launch tables). Returns a JSON-able report. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("run_bench needs a CUDA GPU and torch.cuda.is_available() is False")
    import triton

    ops = list(ops or BENCH_OPS)
    unknown = [o for o in ops if o not in BENCH_OPS]
    if unknown:
        raise ValueError(f"unknown bench op(s) {unknown}; expected some of {list(BENCH_OPS)}")
    if hasattr(torch._dynamo.config, "recompile_limit"):  # one compile per shape and peer
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    say = progress or (lambda _msg: None)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    say("measuring copy bandwidth")
    copy_tbps = copy_bandwidth_tbps(dev)
    liger, liger_info = liger_peers()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(dev))),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger": liger_info,
        "dtype": str(dtype).removeprefix("torch."),
        "copy_tbps": copy_tbps,
        "rows": [],
        "summary": [],
        "sweep": [],
    }
    why = None if liger else liger_info
    for op in ops:
        if sweep and op not in SWEEP_CONFIGS:
            continue
        for w in _workloads(op, dev, dtype, liger, why):
            if sweep:
                say(f"{op} {w.shape}: {len(SWEEP_CONFIGS[op])} launch configs")
                result = _sweep(w, rep)
                if result["best"] and w.bytes_floor:
                    gbps = w.bytes_floor / (result["best"]["ms"] * 1e-3) / 1e9
                    result["best_pct_copy"] = 100 * gbps / (copy_tbps * 1e3)
                report["sweep"].append(result)
            else:
                say(f"{op} {w.shape}")
                rows = _measure(w, copy_tbps, rep)
                report["rows"] += rows
                report["summary"].append(summarize(w, rows))
            del w
            torch.cuda.empty_cache()
    report["kernel_status"] = controls.get_kernel_status()
    return report


# --- the small Python face -------------------------------------------------------------------

def benchmark_kernels(
    batch_size: int = 4, seq_len: int = 512, dim: int = 768, dtype: torch.dtype = torch.bfloat16
) -> dict[str, dict[str, Any]]:
    """Forward+backward time of each op's PyTorch reference and of the public (Triton) op at a
    model-like size: ``{op: {"pytorch_ms", "triton_ms", "speedup", "backend"}}``. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "benchmark_kernels needs a CUDA GPU and none is visible (torch.cuda.is_available() "
            "is False); `hydra-kernels check` tests the kernels on the CPU instead"
        )
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden = batch_size * seq_len, max(64, int(8 * dim / 3 / 64) * 64)
    heads, hd = max(1, dim // 64), 64

    def rnd(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return _randn(*shape, dev=dev, dt=dt)

    shape4 = (batch_size, seq_len, heads, hd)
    cases = {
        spec.name: (
            spec.function(spec.checks[0].ref),
            spec.function(spec.checks[0].fn),
            spec.small_bench(rnd, n, dim, hidden, shape4),
        )
        for spec in OP_SPECS
        if spec.small_bench is not None
    }
    results = {}
    for op, (ref, fused, inputs) in cases.items():
        out = ref(*inputs)
        grad = None if out.dim() == 0 else torch.randn_like(out)
        before = controls.fallback_counts()[op]
        ref_ms = time_ms(fwd_bwd_step(ref, inputs, grad))
        fused_ms = time_ms(fwd_bwd_step(fused, inputs, grad))
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        on_triton = controls.triton_path(op, *tensors) and controls.fallback_counts()[op] == before
        results[op] = {
            "pytorch_ms": ref_ms,
            "triton_ms": fused_ms,
            "speedup": ref_ms / fused_ms,
            "backend": "triton" if on_triton else "reference",
        }
    return results


def print_benchmark_results(results: dict[str, dict[str, Any]]) -> None:
    """Print :func:`benchmark_kernels`' results, one block per op."""
    for op, r in results.items():
        print(f"{OPS_BY_NAME[op].title if op in OPS_BY_NAME else op}:")
        print(f"  PyTorch: {r['pytorch_ms']:.3f} ms")
        ran = "" if r.get("backend") == "triton" else "  (the reference ran: Triton off or failed)"
        print(f"  Triton:  {r['triton_ms']:.3f} ms{ran}")
        print(f"  Speedup: {r['speedup']:.2f}x")
        print()
