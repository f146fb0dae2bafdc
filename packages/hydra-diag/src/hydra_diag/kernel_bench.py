"""Kernel-level GPU benchmarks: ``bench kernels`` (forward), ``bench backward-kernels`` and
``bench swiglu-backward`` (backward only), built on hydra-kernels' public ops and its bench helpers
(:func:`hydra_kernels.bench.time_ms`: median of ``triton.testing.do_bench``, L2 cleared between
runs; :func:`~hydra_kernels.bench.copy_bandwidth_tbps`: the device-to-device copy ceiling).

Backward timing: the forward runs once, then ``torch.autograd.grad(out, inputs, grad,
retain_graph=True)`` is timed alone. "hydra (torch bwd)" is the same fused forward with its
backward switched to PyTorch (``set_op_enabled(op, True, backward=False)``, read at backward time),
which isolates what the fused backward kernel buys. Byte floors count each tensor the pass must
read or write once: GB/s over that floor and its share of the copy bandwidth say how close to
the memory roofline a kernel runs. A peer that fails is reported with its error, not skipped.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_diag.loading import require_cuda_device
from hydra_diag.output import Progress, no_progress

Timer = Callable[[Callable[[], Any]], float]


def cuda_timer(rep: int = 100) -> Timer:
    from hydra_kernels.bench import time_ms

    return lambda fn: time_ms(fn, rep=rep)


def wall_timer(repeats: int = 3) -> Timer:
    """Median wall-clock ms over ``repeats`` calls (CPU runs of this module, in tests)."""

    def timer(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)

    return timer


@dataclass
class Case:
    """One op at one shape: inputs, which of them are differentiated, implementations, byte floors."""

    op: str
    control: str
    shape: str
    inputs: list[Any]
    diff: list[int]
    impls: dict[str, Callable[..., Any]]
    fwd_bytes: float
    bwd_bytes: float
    flops: float = 0.0
    notes: dict[str, str] = field(default_factory=dict)


def rand_tensor(*shape: int, dev, dt, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=dt) * scale


def _peers(op: str, ref: Callable, compile_peers: bool) -> tuple[dict[str, Callable], dict[str, str]]:
    from hydra_kernels.bench import liger_peers

    impls: dict[str, Callable] = {"eager": ref}
    notes: dict[str, str] = {}
    if compile_peers:
        impls["compile"] = torch.compile(ref, dynamic=False)
    liger, why = liger_peers()
    if op in liger:
        impls["liger"] = liger[op]
    else:
        notes["liger"] = why or f"Liger-Kernel has no {op} op with these semantics"
    return impls, notes


def kernel_cases(
    ops: list[str],
    tokens: int,
    dims: tuple[int, ...],
    head_shapes: tuple[tuple[int, ...], ...],
    dev: torch.device,
    dt: torch.dtype,
    compile_peers: bool,
    vocab: int = 32000,
) -> list[Case]:
    """The workloads of ``bench kernels`` / ``bench backward-kernels`` for ``ops``."""
    import hydra_kernels as hk
    from hydra_kernels.ops.swiglu import swiglu_ref

    es = torch.empty((), dtype=dt).element_size()
    n = tokens
    cases = []
    for op in ops:
        if op == "rms_norm":
            for d in dims:
                impls, notes = _peers("rms_norm", hk.rms_norm_ref, compile_peers)
                impls["hydra"] = hk.rms_norm
                cases.append(
                    Case(
                        op,
                        "rms_norm",
                        f"{n}x{d}",
                        [rand_tensor(n, d, dev=dev, dt=dt), 1 + 0.1 * rand_tensor(d, dev=dev, dt=dt)],
                        [0, 1],
                        impls,
                        2 * n * d * es + d * es,
                        3 * n * d * es + 2 * d * es,
                        notes=notes,
                    )
                )
        elif op == "fused_add_rms_norm":
            for d in dims:
                impls, notes = _peers("fused_add_rms_norm", hk.fused_add_rms_norm_ref, compile_peers)
                impls["hydra"] = hk.fused_add_rms_norm
                ins = [
                    rand_tensor(n, d, dev=dev, dt=dt),
                    rand_tensor(n, d, dev=dev, dt=dt),
                    1 + 0.1 * rand_tensor(d, dev=dev, dt=dt),
                ]
                cases.append(
                    Case(
                        op,
                        "rms_norm",
                        f"{n}x{d}",
                        ins,
                        [0, 1, 2],
                        impls,
                        4 * n * d * es + d * es,
                        5 * n * d * es + 2 * d * es,
                        notes=notes,
                    )
                )
        elif op == "swiglu":
            for d in dims:
                h = int(8 * d / 3 / 64) * 64
                impls, notes = _peers("swiglu", swiglu_ref, compile_peers)
                impls["hydra"] = hk.swiglu
                ins = [2 * rand_tensor(n, h, dev=dev, dt=dt), rand_tensor(n, h, dev=dev, dt=dt)]
                cases.append(
                    Case(
                        op,
                        "swiglu",
                        f"{n}x{h}",
                        ins,
                        [0, 1],
                        impls,
                        3 * n * h * es,
                        5 * n * h * es,
                        notes=notes,
                    )
                )
        elif op in ("qk_norm", "rope"):
            for b, s, heads, d in head_shapes:
                x = rand_tensor(b, s, heads, d, dev=dev, dt=dt)
                if op == "qk_norm":
                    impls, notes = _peers("qk_norm", hk.qk_norm_ref, compile_peers)
                    impls["hydra"] = hk.qk_norm
                    temp = 0.1 * torch.randn(heads, device=dev)
                    cases.append(
                        Case(
                            op,
                            "qk_norm",
                            f"{b}x{s}x{heads}x{d}",
                            [x, math.sqrt(d), temp],
                            [0, 2],
                            impls,
                            2 * x.numel() * es,
                            3 * x.numel() * es,
                            notes=notes,
                        )
                    )
                else:
                    impls, notes = _peers("rope", hk.rope_ref, compile_peers)
                    impls["hydra"] = hk.rope
                    ang = torch.rand(s, d // 4, device=dev) * s
                    tables = 2 * ang.numel() * 4
                    cases.append(
                        Case(
                            op,
                            "rope",
                            f"{b}x{s}x{heads}x{d} R={d // 2}",
                            [x, ang.cos(), ang.sin()],
                            [0],
                            impls,
                            2 * x.numel() * es + tables,
                            2 * x.numel() * es + tables,
                            notes=notes,
                        )
                    )
        elif op == "linear_ce":
            for d in dims[:1]:
                impls, notes = _peers("linear_ce", hk.linear_cross_entropy_ref, compile_peers)
                impls["hydra"] = hk.linear_cross_entropy
                ins = [
                    rand_tensor(n, d, dev=dev, dt=dt),
                    rand_tensor(vocab, d, dev=dev, dt=dt, scale=0.02),
                    torch.randint(0, vocab, (n,), device=dev),
                ]
                cases.append(
                    Case(
                        op,
                        "linear_cross_entropy",
                        f"{n}x{d} V={vocab}",
                        ins,
                        [0, 1],
                        impls,
                        0,
                        0,
                        flops=2.0 * n * d * vocab,
                        notes=notes,
                    )
                )
        else:
            from hydra_diag.output import DiagError

            raise DiagError(
                f"unknown op {op!r}; choose from rms_norm, fused_add_rms_norm, swiglu, qk_norm, rope, "
                "linear_ce"
            )
    return cases


def _rate(row: dict[str, Any], nbytes: float, flops: float, copy_tbps: float | None) -> None:
    if row.get("ms"):
        if nbytes:
            row["gbps"] = nbytes / (row["ms"] * 1e-3) / 1e9
            row["pct_copy"] = 100 * row["gbps"] / (copy_tbps * 1e3) if copy_tbps else None
        if flops:
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12


def _fallbacks(control: str) -> int:
    import hydra_kernels

    return hydra_kernels.fallback_counts()[control]


def _timed_row(
    case: Case, name: str, measure: Callable[[], float], nbytes: float, flops: float, copy_tbps: float | None
) -> dict[str, Any]:
    """One implementation's row: ``measure()`` ms (or the error it raised), marked when hydra's
    Triton kernel fell back to the reference while being timed, with its rates."""
    row: dict[str, Any] = {"op": case.op, "shape": case.shape, "impl": name, "ms": None}
    before = _fallbacks(case.control)
    try:
        row["ms"] = measure()
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if name.startswith("hydra") and _fallbacks(case.control) > before:
        row["error"] = "the Triton kernel failed and the reference ran (not timed fairly)"
    _rate(row, nbytes, flops, copy_tbps)
    return row


def _note_rows(case: Case) -> list[dict[str, Any]]:
    """Peers that did not run (e.g. Liger without the op), with why."""
    return [
        {"op": case.op, "shape": case.shape, "impl": k, "ms": None, "note": v} for k, v in case.notes.items()
    ]


def time_forward(case: Case, timer: Timer, copy_tbps: float | None) -> list[dict[str, Any]]:
    """Forward-only time of each implementation (no autograd graph)."""

    def measure(fn: Callable) -> float:
        inputs = fresh_inputs(case, grad=False)
        with torch.no_grad():
            return timer(lambda: fn(*inputs))

    rows = [
        _timed_row(case, name, lambda fn=fn: measure(fn), case.fwd_bytes, case.flops, copy_tbps)
        for name, fn in case.impls.items()
    ]
    return rows + _note_rows(case)


def fresh_inputs(case: Case, grad: bool) -> list[Any]:
    """A private copy of the inputs for one implementation. Peers may write into their inputs
    (Liger's SwiGLU backward stores the gradients over the saved gate and up tensors), which would
    hand every implementation timed after them different, drifting data."""
    return [
        a.detach().clone().requires_grad_(grad and i in case.diff)
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for i, a in enumerate(case.inputs)
    ]


def backward_step(fn: Callable, inputs: list[Any], diff: list[int]) -> Callable[[], Any]:
    """A closure computing only the backward of one fixed forward of ``fn``."""
    out = fn(*inputs)
    outs = [
        o
        for o in (out if isinstance(out, tuple) else (out,))
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    grads = [torch.randn_like(o) for o in outs]
    wrt = [inputs[i] for i in diff]
    return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)


def time_backward(
    case: Case, timer: Timer, copy_tbps: float | None, torch_bwd_variant: bool = True
) -> list[dict[str, Any]]:
    """Backward-only time per implementation, plus hydra's fused forward with a PyTorch backward."""
    import hydra_kernels as hk

    variants: list[tuple[str, Callable, bool]] = [(k, f, True) for k, f in case.impls.items()]
    if torch_bwd_variant and "hydra" in case.impls:
        variants.append(("hydra (torch bwd)", case.impls["hydra"], False))
    rows = []
    for name, fn, fused_bwd in variants:
        status = hk.get_kernel_status()["ops"][case.control]

        def measure(fn: Callable = fn, fused_bwd: bool = fused_bwd, status: dict = status) -> float:
            if not fused_bwd:
                hk.set_op_enabled(case.control, status["enabled"], backward=False)
            return timer(backward_step(fn, fresh_inputs(case, grad=True), case.diff))

        try:
            rows.append(_timed_row(case, name, measure, case.bwd_bytes, 0.0, copy_tbps))
        finally:
            hk.set_op_enabled(case.control, status["enabled"], backward=status["backward_enabled"])
    return rows + _note_rows(case)


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (op, shape): hydra's ms, the fastest peer and hydra's speedup over it."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["op"], r["shape"])
        s = out.setdefault(key, {"op": r["op"], "shape": r["shape"]})
        if r.get("ms"):
            s[r["impl"]] = r["ms"]
            if r["impl"] == "hydra":
                s.update({k: r.get(k) for k in ("gbps", "pct_copy", "tflops") if r.get(k) is not None})
    for s in out.values():
        peers = {k: v for k, v in s.items() if k in ("eager", "compile", "liger") and v}
        if s.get("hydra") and peers:
            best = min(peers, key=peers.get)
            s["best_peer"], s["speedup_vs_best_peer"] = best, peers[best] / s["hydra"]
    return list(out.values())


def bench_setup(
    device: str | None, tool: str, rep: int
) -> tuple[torch.device, Timer, float | None, dict[str, Any]]:
    dev = torch.device(device) if device else require_cuda_device(tool)
    if dev.type == "cuda":
        import triton

        from hydra_kernels.bench import copy_bandwidth_tbps

        copy = copy_bandwidth_tbps(dev)
        env = {
            "device": torch.cuda.get_device_name(dev),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_tbps": copy,
        }
        return dev, cuda_timer(rep), copy, env
    return dev, wall_timer(), None, {"device": str(dev), "torch": torch.__version__, "copy_tbps": None}


DEFAULT_HEAD_SHAPES = ((8, 2048, 6, 64), (8, 2048, 16, 128))


def _bench_pass(
    backward: bool,
    ops: list[str],
    tokens: int,
    dims: tuple[int, ...],
    head_shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype,
    compile_peers: bool,
    rep: int,
    device: str | None,
    progress: Progress,
) -> dict[str, Any]:
    """``bench kernels`` (forward) or ``bench backward-kernels``: every case of ``ops`` timed."""
    tool = "bench backward-kernels" if backward else "bench kernels"
    dev, timer, copy, env = bench_setup(device, tool, rep)
    rows = []
    for case in kernel_cases(ops, tokens, dims, head_shapes, dev, dtype, compile_peers):
        if backward:
            progress(f"{case.op} {case.shape} backward")
            rows += time_backward(case, timer, copy)
        else:
            progress(f"{case.op} {case.shape}")
            rows += time_forward(case, timer, copy)
    return {
        "tool": "benchmark_backward_kernels" if backward else "benchmark_kernels",
        "pass": "backward" if backward else "forward",
        **env,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "summary": _summary(rows),
    }


def bench_kernels_forward(
    ops: list[str] | None = None,
    tokens: int = 16384,
    dims: tuple[int, ...] = (768, 2048, 4096),
    head_shapes: tuple[tuple[int, ...], ...] = DEFAULT_HEAD_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    compile_peers: bool = True,
    rep: int = 50,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Forward-only ms, GB/s and % of copy bandwidth of each op against eager, compile and Liger."""
    ops = ops or ["rms_norm", "fused_add_rms_norm", "swiglu", "qk_norm", "rope", "linear_ce"]
    return _bench_pass(False, ops, tokens, dims, head_shapes, dtype, compile_peers, rep, device, progress)


def bench_backward_kernels(
    ops: list[str] | None = None,
    tokens: int = 16384,
    dims: tuple[int, ...] = (768, 2048, 4096),
    head_shapes: tuple[tuple[int, ...], ...] = DEFAULT_HEAD_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    compile_peers: bool = True,
    rep: int = 50,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Backward-only ms, GB/s and % of copy bandwidth for SwiGLU, RMSNorm and QK-norm."""
    ops = ops or ["swiglu", "rms_norm", "qk_norm"]
    return _bench_pass(True, ops, tokens, dims, head_shapes, dtype, compile_peers, rep, device, progress)


def bench_swiglu_backward(
    tokens: tuple[int, ...] = (2048, 8192, 16384, 32768),
    widths: tuple[int, ...] = (1408, 2048, 2730, 5440, 10880),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    rep: int = 30,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """SwiGLU backward across shapes and dtypes: fused, PyTorch backward, eager, packed layout."""
    import hydra_kernels as hk
    from hydra_kernels.launch_config import resolve_launch_config
    from hydra_kernels.ops import swiglu as swiglu_mod

    dev, timer, copy, env = bench_setup(device, "bench swiglu-backward", rep)
    rows = []
    for dt in dtypes:
        es = torch.empty((), dtype=dt).element_size()
        for n in tokens:
            for h in widths:
                progress(f"{str(dt).removeprefix('torch.')} {n}x{h}")
                ins = [2 * rand_tensor(n, h, dev=dev, dt=dt), rand_tensor(n, h, dev=dev, dt=dt)]
                case = Case(
                    "swiglu",
                    "swiglu",
                    f"{n}x{h}",
                    ins,
                    [0, 1],
                    {"hydra": hk.swiglu, "eager": swiglu_mod.swiglu_ref},
                    3 * n * h * es,
                    5 * n * h * es,
                )
                packed = Case(
                    "swiglu",
                    "swiglu",
                    f"{n}x{h}",
                    [torch.cat(ins, dim=1)],
                    [0],
                    {"hydra packed": hk.swiglu_packed},
                    3 * n * h * es,
                    5 * n * h * es,
                )
                for r in time_backward(case, timer, copy) + time_backward(
                    packed, timer, copy, torch_bwd_variant=False
                ):
                    rows.append(
                        {
                            **r,
                            "dtype": str(dt).removeprefix("torch."),
                            "tokens": n,
                            "width": h,
                            "bytes": 5 * n * h * es,
                        }
                    )
                del ins, case, packed
    launch = None
    if dev.type == "cuda":
        cfg = resolve_launch_config("swiglu", dev, swiglu_mod.LAUNCH_DEFAULTS)
        launch = {k: getattr(cfg, k) for k in ("block_q", "num_warps") if hasattr(cfg, k)}
    return {"tool": "benchmark_swiglu_backward", **env, "launch_config": launch, "rows": rows}


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
