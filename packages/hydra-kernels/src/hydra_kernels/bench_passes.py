"""Single-pass kernel benchmarks: the forward alone, or the backward alone, of each fused op against
its peers (the library behind ``hydra-diag bench kernels``, ``bench backward-kernels`` and
``bench swiglu-backward``). Timing, peers and rows are :mod:`hydra_kernels.bench_harness`'s.

Backward timing: the forward runs once, then ``torch.autograd.grad(out, inputs, grad,
retain_graph=True)`` is timed alone. "hydra (torch bwd)" is the same fused forward with its
backward switched to PyTorch (``set_op_enabled(op, True, backward=False)``, read at backward time),
which isolates what the fused backward kernel buys. Byte floors count each tensor the pass must
read or write once: GB/s over that floor and its share of the copy bandwidth say how close to
the memory roofline a kernel runs. A peer that fails is reported with its error, not skipped.

Every function takes ``device``: None means the current CUDA device (an error without one);
``"cpu"`` runs the same code with a wall-clock timer, for tests only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_kernels.bench_harness import (
    Timer,
    backward_step,
    bench_setup,
    liger_peers,
    note_rows,
    peers,
    private_copy,
    rand_tensor,
    timed_row,
)

Progress = Callable[[str], None]


def _quiet(_message: str) -> None:
    """The default progress callback: say nothing."""


@dataclass
class Case:
    """One op at one shape: inputs, which of them are differentiated, implementations, byte floors."""

    op: str
    control: str  # its switch in hydra_kernels.controls
    shape: str
    inputs: list[Any]
    diff: list[int]
    impls: dict[str, Callable[..., Any]]
    fwd_bytes: float
    bwd_bytes: float
    flops: float = 0.0
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class _Sizes:
    """What the case builders need: the shapes asked for, the device and dtype, the peers."""

    tokens: int
    dims: tuple[int, ...]
    head_shapes: tuple[tuple[int, ...], ...]
    dev: torch.device
    dt: torch.dtype
    peers: Callable[[str, Callable[..., Any]], tuple[dict[str, Callable[..., Any]], dict[str, str]]]
    vocab: int

    @property
    def es(self) -> int:
        return torch.empty((), dtype=self.dt).element_size()

    def rand(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return rand_tensor(*shape, dev=self.dev, dt=self.dt, scale=scale)

    def impls(self, op: str, ref: Callable[..., Any], hydra: Callable[..., Any]):
        impls, notes = self.peers(op, ref)
        impls["hydra"] = hydra
        return impls, notes


def _rms_norm_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk

    n, es = z.tokens, z.es
    out = []
    for d in z.dims:
        impls, notes = z.impls("rms_norm", hk.rms_norm_ref, hk.rms_norm)
        ins = [z.rand(n, d), 1 + 0.1 * z.rand(d)]
        out.append(
            Case("rms_norm", "rms_norm", f"{n}x{d}", ins, [0, 1], impls,
                 2 * n * d * es + d * es, 3 * n * d * es + 2 * d * es, notes=notes)
        )  # fmt: skip
    return out


def _fused_add_rms_norm_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk

    n, es = z.tokens, z.es
    out = []
    for d in z.dims:
        impls, notes = z.impls("fused_add_rms_norm", hk.fused_add_rms_norm_ref, hk.fused_add_rms_norm)
        ins = [z.rand(n, d), z.rand(n, d), 1 + 0.1 * z.rand(d)]
        out.append(
            Case("fused_add_rms_norm", "rms_norm", f"{n}x{d}", ins, [0, 1, 2], impls,
                 4 * n * d * es + d * es, 5 * n * d * es + 2 * d * es, notes=notes)
        )  # fmt: skip
    return out


def _swiglu_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk
    from hydra_kernels.ops.swiglu import swiglu_ref

    n, es = z.tokens, z.es
    out = []
    for d in z.dims:
        h = int(8 * d / 3 / 64) * 64  # the MLP widths of the presets
        impls, notes = z.impls("swiglu", swiglu_ref, hk.swiglu)
        ins = [2 * z.rand(n, h), z.rand(n, h)]
        out.append(
            Case("swiglu", "swiglu", f"{n}x{h}", ins, [0, 1], impls, 3 * n * h * es, 5 * n * h * es,
                 notes=notes)
        )  # fmt: skip
    return out


def _qk_norm_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk

    out = []
    for b, s, heads, d in z.head_shapes:
        x = z.rand(b, s, heads, d)
        impls, notes = z.impls("qk_norm", hk.qk_norm_ref, hk.qk_norm)
        temp = 0.1 * torch.randn(heads, device=z.dev)
        out.append(
            Case("qk_norm", "qk_norm", f"{b}x{s}x{heads}x{d}", [x, math.sqrt(d), temp], [0, 2], impls,
                 2 * x.numel() * z.es, 3 * x.numel() * z.es, notes=notes)
        )  # fmt: skip
    return out


def _rope_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk

    out = []
    for b, s, heads, d in z.head_shapes:
        x = z.rand(b, s, heads, d)
        impls, notes = z.impls("rope", hk.rope_ref, hk.rope)
        ang = torch.rand(s, d // 4, device=z.dev) * s
        tables = 2 * ang.numel() * 4  # fp32 cos and sin
        floor = 2 * x.numel() * z.es + tables
        out.append(
            Case("rope", "rope", f"{b}x{s}x{heads}x{d} R={d // 2}", [x, ang.cos(), ang.sin()], [0], impls,
                 floor, floor, notes=notes)
        )  # fmt: skip
    return out


def _linear_ce_cases(z: _Sizes) -> list[Case]:
    import hydra_kernels as hk

    n, v = z.tokens, z.vocab
    out = []
    for d in z.dims[:1]:  # compute-bound: one width says enough
        impls, notes = z.impls("linear_ce", hk.linear_cross_entropy_ref, hk.linear_cross_entropy)
        ins = [z.rand(n, d), z.rand(v, d, scale=0.02), torch.randint(0, v, (n,), device=z.dev)]
        out.append(
            Case("linear_ce", "linear_cross_entropy", f"{n}x{d} V={v}", ins, [0, 1], impls, 0, 0,
                 flops=2.0 * n * d * v, notes=notes)
        )  # fmt: skip
    return out


#: The ops of the single-pass benchmarks and their cases, in the order they run.
PASS_CASES: dict[str, Callable[[_Sizes], list[Case]]] = {
    "rms_norm": _rms_norm_cases,
    "fused_add_rms_norm": _fused_add_rms_norm_cases,
    "swiglu": _swiglu_cases,
    "qk_norm": _qk_norm_cases,
    "rope": _rope_cases,
    "linear_ce": _linear_ce_cases,
}
PASS_OPS: tuple[str, ...] = tuple(PASS_CASES)


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
    """The workloads of the forward and backward passes for ``ops`` (a ValueError names an
    unknown one)."""
    unknown = [op for op in ops if op not in PASS_CASES]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}; choose from {', '.join(PASS_OPS)}")
    liger, why = liger_peers()

    def with_peers(op: str, ref: Callable[..., Any]):
        return peers(op, ref, liger, None if liger else why, with_compile=compile_peers)

    sizes = _Sizes(tokens, dims, head_shapes, dev, dt, with_peers, vocab)
    return [case for op in ops for case in PASS_CASES[op](sizes)]


def fresh_inputs(case: Case, grad: bool) -> list[Any]:
    """A private copy of the inputs for one implementation (see
    :func:`~hydra_kernels.bench_harness.private_copy`), the differentiated ones requiring
    gradients when ``grad``."""
    return [private_copy(a, grad and i in case.diff) for i, a in enumerate(case.inputs)]


def time_forward(case: Case, timer: Timer, copy_tbps: float | None) -> list[dict[str, Any]]:
    """Forward-only time of each implementation (no autograd graph)."""

    def measure(fn: Callable[..., Any]) -> float:
        inputs = fresh_inputs(case, grad=False)
        with torch.no_grad():
            return timer(lambda: fn(*inputs))

    rows = [
        timed_row(case.op, case.shape, name, case.control, lambda _row, fn=fn: measure(fn),
                  case.fwd_bytes, case.flops, copy_tbps)
        for name, fn in case.impls.items()
    ]  # fmt: skip
    return rows + note_rows(case.op, case.shape, case.notes)


def time_backward(
    case: Case, timer: Timer, copy_tbps: float | None, torch_bwd_variant: bool = True
) -> list[dict[str, Any]]:
    """Backward-only time per implementation, plus hydra's fused forward with a PyTorch backward
    (the op's backward switch is restored after each)."""
    import hydra_kernels as hk

    variants: list[tuple[str, Callable[..., Any], bool]] = [(k, f, True) for k, f in case.impls.items()]
    if torch_bwd_variant and "hydra" in case.impls:
        variants.append(("hydra (torch bwd)", case.impls["hydra"], False))
    rows = []
    for name, fn, fused_bwd in variants:
        status = hk.get_kernel_status()["ops"][case.control]

        def measure(_row: dict[str, Any], fn=fn, fused_bwd: bool = fused_bwd, status=status) -> float:
            if not fused_bwd:
                hk.set_op_enabled(case.control, status["enabled"], backward=False)
            return timer(backward_step(fn, fresh_inputs(case, grad=True), case.diff))

        try:
            rows.append(
                timed_row(case.op, case.shape, name, case.control, measure, case.bwd_bytes, 0.0, copy_tbps)
            )
        finally:
            hk.set_op_enabled(case.control, status["enabled"], backward=status["backward_enabled"])
    return rows + note_rows(case.op, case.shape, case.notes)


def speedup_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (op, shape): each implementation's ms, hydra's rates, the fastest of eager, compile and
    Liger and hydra's speedup over it."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        s = out.setdefault((r["op"], r["shape"]), {"op": r["op"], "shape": r["shape"]})
        if r.get("ms"):
            s[r["impl"]] = r["ms"]
            if r["impl"] == "hydra":
                s.update({k: r.get(k) for k in ("gbps", "pct_copy", "tflops") if r.get(k) is not None})
    for s in out.values():
        found = {k: v for k, v in s.items() if k in ("eager", "compile", "liger") and v}
        if s.get("hydra") and found:
            best = min(found, key=found.get)
            s["best_peer"], s["speedup_vs_best_peer"] = best, found[best] / s["hydra"]
    return list(out.values())


def _device(device: torch.device | str | None, tool: str) -> torch.device:
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        raise RuntimeError(f"{tool} needs a CUDA GPU and torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())


DEFAULT_HEAD_SHAPES = ((8, 2048, 6, 64), (8, 2048, 16, 128))


def bench_pass(
    backward: bool,
    ops: list[str] | None = None,
    tokens: int = 16384,
    dims: tuple[int, ...] = (768, 2048, 4096),
    head_shapes: tuple[tuple[int, ...], ...] = DEFAULT_HEAD_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    compile_peers: bool = True,
    rep: int = 50,
    device: torch.device | str | None = None,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """The forward (or with ``backward`` the backward) of every case of ``ops`` against its peers:
    ms, GB/s over the pass's byte floor, % of the copy bandwidth (TFLOP/s for linear+CE). Default
    ops: all for the forward; SwiGLU, RMSNorm and QK-norm (the fused backward kernels) for the
    backward."""
    name = "benchmark_backward_kernels" if backward else "benchmark_kernels"
    ops = list(ops or (["swiglu", "rms_norm", "qk_norm"] if backward else PASS_OPS))
    dev = _device(device, name)
    timer, copy, env = bench_setup(dev, rep)
    rows = []
    for case in kernel_cases(ops, tokens, dims, head_shapes, dev, dtype, compile_peers):
        if backward:
            progress(f"{case.op} {case.shape} backward")
            rows += time_backward(case, timer, copy)
        else:
            progress(f"{case.op} {case.shape}")
            rows += time_forward(case, timer, copy)
    return {
        "tool": name,
        "pass": "backward" if backward else "forward",
        **env,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "summary": speedup_summary(rows),
    }


def bench_swiglu_backward(
    tokens: tuple[int, ...] = (2048, 8192, 16384, 32768),
    widths: tuple[int, ...] = (1408, 2048, 2730, 5440, 10880),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    rep: int = 30,
    device: torch.device | str | None = None,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """SwiGLU backward across shapes and dtypes: fused, PyTorch backward, eager, packed layout."""
    import hydra_kernels as hk
    from hydra_kernels.launch_config import resolve_launch_config
    from hydra_kernels.ops import swiglu as swiglu_mod

    dev = _device(device, "benchmark_swiglu_backward")
    timer, copy, env = bench_setup(dev, rep)
    rows = []
    for dt in dtypes:
        es, dt_name = torch.empty((), dtype=dt).element_size(), str(dt).removeprefix("torch.")
        for n in tokens:
            for h in widths:
                progress(f"{dt_name} {n}x{h}")
                ins = [2 * rand_tensor(n, h, dev=dev, dt=dt), rand_tensor(n, h, dev=dev, dt=dt)]
                floors = (3 * n * h * es, 5 * n * h * es)
                split = Case("swiglu", "swiglu", f"{n}x{h}", ins, [0, 1],
                             {"hydra": hk.swiglu, "eager": swiglu_mod.swiglu_ref}, *floors)  # fmt: skip
                packed = Case("swiglu", "swiglu", f"{n}x{h}", [torch.cat(ins, dim=1)], [0],
                              {"hydra packed": hk.swiglu_packed}, *floors)  # fmt: skip
                timed = time_backward(split, timer, copy) + time_backward(
                    packed, timer, copy, torch_bwd_variant=False
                )
                for r in timed:
                    rows.append({**r, "dtype": dt_name, "tokens": n, "width": h, "bytes": 5 * n * h * es})
                del ins, split, packed
    launch = None
    if dev.type == "cuda":
        cfg = resolve_launch_config("swiglu", dev, swiglu_mod.LAUNCH_DEFAULTS)
        launch = {k: getattr(cfg, k) for k in ("block_q", "num_warps") if hasattr(cfg, k)}
    return {"tool": "benchmark_swiglu_backward", **env, "launch_config": launch, "rows": rows}
