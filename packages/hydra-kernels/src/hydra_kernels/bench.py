"""Benchmarks of the fused ops against torch eager, torch.compile and Liger-Kernel (CUDA only).

Every figure is forward+backward, the median of ``triton.testing.do_bench`` on random inputs,
timed through :mod:`hydra_kernels.bench_harness` (the timing, peers and rows every kernel
benchmark shares; the single-pass benchmarks are :mod:`hydra_kernels.bench_passes`).
Bandwidth counts the byte floor of docs/TARGETS.md (each input read once and each output written once,
over forward and backward) and is set against the device-to-device copy bandwidth measured at the
start of the run. linear+CE is compute-bound: it reports TFLOP/s (6·N·D·V) and the peak memory
allocated above its inputs during one call.

:func:`run_bench` is what ``hydra-kernels bench`` runs; :func:`benchmark_kernels` and
:func:`print_benchmark_results` are the small Python-level face.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_kernels import controls
from hydra_kernels.bench_harness import (
    copy_bandwidth_tbps,
    environment,
    fwd_bwd_step,
    graph_ms,
    liger_peers,
    note_rows,
    peak_extra_mib,
    private_copy,
    time_ms,
    timed_row,
)
from hydra_kernels.launch_config import (
    clear_launch_overrides,
    resolve_launch_config,
    set_launch_overrides,
)
from hydra_kernels.ops.linear_cross_entropy import linear_cross_entropy
from hydra_kernels.registry import OP_SPECS, OPS_BY_NAME, canonical_op
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
    """The workloads of bench op ``op`` (its registry entry's generator; an alias is taken too)."""
    op = canonical_op(op)
    if op not in BENCH_OPS:
        raise ValueError(f"unknown bench op {op!r}; expected one of {', '.join(BENCH_OPS)}")
    yield from OPS_BY_NAME[BENCH_OPS[op]].bench[op](dev, dt, liger, why)


# --- measurement -----------------------------------------------------------------------------


def _measure(w: Workload, copy_tbps: float, rep: int) -> list[dict[str, Any]]:
    """A row per implementation of ``w`` (forward+backward, each on its own copy of the inputs)
    and one per peer that did not run."""
    rows = []
    for impl, fn in w.impls.items():

        def measure(row: dict[str, Any], impl: str = impl, fn: Callable[..., Any] = fn) -> float:
            step = fwd_bwd_step(fn, [private_copy(t) for t in w.inputs], private_copy(w.grad_out))
            if w.measure_memory:
                row["peak_extra_mib"] = round(peak_extra_mib(step), 1)
            row["ms"] = time_ms(step, rep)
            if impl in GRAPH_IMPLS and not w.measure_memory:
                row["graph_ms"] = graph_ms(step, rep)
            return row["ms"]

        rows.append(
            timed_row(w.op, w.shape, impl, BENCH_OPS[w.op], measure, w.bytes_floor, w.flops, copy_tbps)
        )
    return rows + note_rows(w.op, w.shape, w.notes)


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
        if w.op == "linear_cross_entropy":
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
    if w.op == "linear_cross_entropy":  # the other dW schemes against the same two targets
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
    ops = [canonical_op(o) for o in ops or BENCH_OPS]
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
        **environment(dev),
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
