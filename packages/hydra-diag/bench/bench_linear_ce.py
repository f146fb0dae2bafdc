"""Tuning harness for linear_cross_entropy on one GPU: check, time, measure memory, pick configs.

    python packages/hydra-diag/bench/bench_linear_ce.py          # everything, ~2-3 min on an H100
    python packages/hydra-diag/bench/bench_linear_ce.py --smoke  # tiny shapes on the CPU interpreter

1. Correctness on CUDA at a moderate odd shape (N=1537, D=320, V=5003, a fifth of the targets
   ignored, z-loss): the default path in bf16 and fp32, mean / sum / none, the lean mode and the
   Liger hand-off, every output and gradient against fp64 with the project criterion
   (hydra_kernels.numerics) plus the op's gradient-rounding tolerance (grad_rounding_atol). The
   lean mode is reported, not required to pass: it trades that precision for memory.
2. Forward+backward time (triton.testing.do_bench median) and peak memory above the inputs after
   a warm call (as the targets in docs/TARGETS.md are measured: the previous call's
   gradients are still allocated at the base and freed by the step) at the docs/TARGETS.md shapes
   16384×768 V=50304 and 16384×2048 V=128256, for hydra variants (chunk rows, dW backend, lean
   mode, row-kernel launch settings) and the peers: torch eager, torch.compile, Liger (its
   default bf16 dW accumulation, and with accum_dtype=fp32).
3. Per-chunk breakdown of the default config: the logits GEMM, the row kernel, the dh GEMM and
   the dW accumulation (cuBLAS fp32-out, Triton GEMM, cuBLAS bf16), each timed alone.

Variants fail independently (the error is printed in the row). JSON of everything goes to
$OUT/bench_linear_ce.json when $OUT is set. Exit 1 if a required correctness check fails or a
Triton kernel fell back.
"""

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

try:
    import hydra_kernels
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hydra-kernels" / "src"))
    import hydra_kernels

from rich.console import Console
from rich.table import Table

from hydra_kernels import controls
from hydra_kernels.bench import peak_extra_mib
from hydra_kernels.cli_support import console, emit_json, fail, require_cuda
from hydra_kernels.launch_config import clear_launch_overrides, set_launch_overrides
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import _linear_ce_chunks as chunks
from hydra_kernels.ops import _linear_ce_kernels as kernels
from hydra_kernels.ops import linear_cross_entropy as lce
from hydra_kernels.ops._linear_ce_liger import positional_args

OP = "linear_cross_entropy"
#: docs/TARGETS.md targets per shape: (ms, MiB) = torch.compile's time and Liger's memory.
TARGETS = {(768, 50304): (7.46, 25.0), (2048, 128256): (44.4, 125.0)}

#: hydra variants: name -> (set_linear_ce_options kwargs, row-kernel launch overrides,
#: row programs per SM or None, dW-GEMM launch overrides).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, int], int | None, dict[str, int]]] = {
    "hydra": ({}, {}, None, {}),
    "hydra c1024": ({"chunk_rows": 1024}, {}, None, {}),
    "hydra c2048": ({"chunk_rows": 2048}, {}, None, {}),
    "hydra c4096": ({"chunk_rows": 4096}, {}, None, {}),
    "hydra dW=triton": ({"dw_backend": "triton"}, {}, None, {}),
    "hydra dW=triton 128x64": ({"dw_backend": "triton"}, {}, None, {"block_q": 128, "block_kv": 64}),
    "hydra dW=triton 4 stages": ({"dw_backend": "triton"}, {}, None, {"num_stages": 4}),
    "hydra rows 8 warps": ({}, {"num_warps": 8}, None, {}),
    "hydra rows block 4096": ({}, {"block_q": 4096}, None, {}),
    "hydra rows 1 prog/SM": ({}, {}, 1, {}),
    "hydra rows 4 prog/SM": ({}, {}, 4, {}),
    "hydra lean": ({"dw_accum": "input"}, {}, None, {}),
    "hydra lean c1024": ({"dw_accum": "input", "chunk_rows": 1024}, {}, None, {}),
}
PEERS = ("torch eager", "torch.compile", "liger", "liger fp32-acc")


class Setup:
    device = "cuda"
    smoke = False
    shapes: tuple[tuple[int, int, int], ...] = ((16384, 768, 50304), (16384, 2048, 128256))
    check_shape = (1537, 320, 5003)

    @classmethod
    def use_smoke(cls) -> None:
        cls.device, cls.smoke = "cpu", True
        cls.shapes = ((96, 48, 301),)
        cls.check_shape = (37, 48, 301)


def _sync() -> None:
    if Setup.device == "cuda":
        torch.cuda.synchronize()


def _ms(fn: Callable[[], Any], rep: int) -> float:
    if Setup.smoke:  # wall clock, one call: only shows that the script runs
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    fn()
    _sync()
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def _peak_extra_mib(step: Callable[[], None]) -> float | None:
    return peak_extra_mib(step) if Setup.device == "cuda" else None  # no allocator stats on the CPU


def _liger_fn():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:
        return None
    return LigerFusedLinearCrossEntropyFunction


def _liger_version() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("liger-kernel")
    except Exception:
        return None


class _Config:
    """Applies one hydra variant's options and launch overrides; undoes them on exit."""

    def __init__(self, name: str):
        self.opts, self.rows, self.per_sm, self.dw = VARIANTS[name]

    def __enter__(self):
        lce.set_linear_ce_options(**self.opts)
        if self.rows:
            set_launch_overrides("linear_cross_entropy_rows", **self.rows)
        if self.dw:
            set_launch_overrides(OP, **self.dw)
        self.saved = dict(kernels.ROW_PROGRAMS_PER_SM)
        if self.per_sm:
            kernels.ROW_PROGRAMS_PER_SM.update(dict.fromkeys(self.saved, self.per_sm))
        return self

    def __exit__(self, *exc):
        lce.reset_linear_ce_options()
        clear_launch_overrides()
        kernels.ROW_PROGRAMS_PER_SM.update(self.saved)


# --- 1. correctness ---------------------------------------------------------------------------


def _outputs(fn, h, w, y, dtype, reduction, z_loss, g):
    hh = h.detach().to(dtype, copy=True).requires_grad_()  # fresh leaves: no shared .grad
    ww = w.detach().to(dtype, copy=True).requires_grad_()
    out = fn(hh, ww, y, -100, reduction, z_loss)
    out = out[0] if isinstance(out, tuple) else out
    (out * g.to(out.dtype)).sum().backward()
    return out.detach(), hh.grad, ww.grad


def _criterion(got, same, ref, extra) -> tuple[bool, str]:
    atol = fp32_noise_atol(ref) + extra
    if isinstance(atol, torch.Tensor):  # elementwise atol: divide everything by it (same criterion)
        res = check_against_fp64(got.double() / atol, same.double() / atol, ref / atol, 1.0)
    else:
        res = check_against_fp64(got, same, ref, atol)
    return res.passed, res.describe() + (
        " [in units of the elementwise atol]" if isinstance(atol, torch.Tensor) else ""
    )


def run_checks(seed: int | None = None) -> list[dict[str, Any]]:
    n, d, v = Setup.check_shape
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    gen = torch.Generator(device=Setup.device).manual_seed(seed)
    h = torch.randn(n, d, generator=gen, device=Setup.device, dtype=torch.float64)
    w = 0.05 * torch.randn(v, d, generator=gen, device=Setup.device, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=gen, device=Setup.device)
    y[torch.rand(n, generator=gen, device=Setup.device) < 0.2] = -100
    cases = [
        ("hydra", torch.bfloat16, "mean", 1e-3, True),
        ("hydra", torch.bfloat16, "none", 1e-3, True),
        ("hydra", torch.float32, "sum", 0.0, True),
        ("hydra c512 dW=triton", torch.bfloat16, "mean", 0.0, True),
        ("hydra lean", torch.bfloat16, "mean", 0.0, False),
        ("liger hand-off", torch.bfloat16, "mean", 1e-3, True),
    ]
    rows = []
    for name, dtype, reduction, z_loss, required in cases:
        row = {"case": f"{name} {str(dtype)[6:]} {reduction} z={z_loss}", "required": required, "seed": seed}
        try:
            if name == "liger hand-off" and (_liger_fn() is None or Setup.device != "cuda"):
                row.update(
                    passed=None, detail="Liger not importable here" if Setup.device == "cuda" else "CPU"
                )
                rows.append(row)
                continue
            g = torch.linspace(-1, 2, n, device=Setup.device, dtype=torch.float64)
            g = g if reduction == "none" else torch.tensor(1.0, device=Setup.device, dtype=torch.float64)
            lce.set_linear_ce_options(chunk_rows=512 if "c512" in name else 0)
            if "triton" in name:
                lce.set_linear_ce_options(dw_backend="triton")
            if "lean" in name:
                lce.set_linear_ce_options(dw_accum="input")
            controls.set_use_liger_ce(name == "liger hand-off")
            got = _outputs(lce.linear_cross_entropy, h, w, y, dtype, reduction, z_loss, g)
            same = _outputs(lce.linear_cross_entropy_ref, h, w, y, dtype, reduction, z_loss, g)
            ref = _outputs(lce.linear_cross_entropy_ref, h, w, y, torch.float64, reduction, z_loss, g)
            flips = lce.grad_rounding_atol(h, w, y, dtype, -100, reduction, z_loss, g)
            verdicts = [_criterion(got[0], same[0], ref[0], 0.0)]
            verdicts += [
                _criterion(k, t, r, e) for k, t, r, e in zip(got[1:], same[1:], ref[1:], flips, strict=True)
            ]
            row["passed"] = all(ok for ok, _ in verdicts)
            row["detail"] = " | ".join(
                f"{t}: {msg}" for t, (_, msg) in zip(("loss", "dh", "dW"), verdicts, strict=True)
            )
        except Exception as exc:
            row.update(passed=False, detail=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            lce.reset_linear_ce_options()
            controls.set_use_liger_ce(False)
        rows.append(row)
    return rows


# --- 2. timing and memory ---------------------------------------------------------------------


def _impl(name: str, compiled: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    if name in VARIANTS:
        return lambda h, w, y: lce.linear_cross_entropy(h, w, y)
    if name == "torch eager":
        return lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y)
    if name == "torch.compile":
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(
                lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y)
            )
        return compiled["fn"]
    fn = _liger_fn()
    if fn is None:
        raise RuntimeError("liger_kernel is not importable")
    if name == "liger":
        return lambda h, w, y: fn.apply(h, w, y)[0]
    args = {"_input": None, "weight": None, "target": None, "accum_dtype": torch.float32}
    order = positional_args(fn.forward, args)  # raises if this Liger has no accum_dtype
    return lambda h, w, y: fn.apply(h, w, y, *order[3:])[0]


def time_shape(n: int, d: int, v: int, names: list[str], rep: int) -> list[dict[str, Any]]:
    dt = torch.bfloat16
    h = torch.randn(n, d, device=Setup.device, dtype=dt).requires_grad_()
    w = (0.02 * torch.randn(v, d, device=Setup.device, dtype=dt)).requires_grad_()
    y = torch.randint(0, v, (n,), device=Setup.device)
    flops = 6.0 * n * d * v
    compiled: dict[str, Callable[..., Any]] = {}
    rows = []
    for name in names:
        row: dict[str, Any] = {"shape": f"{n}x{d} V={v}", "impl": name, "ms": None, "MiB": None}
        if name in VARIANTS:
            o = chunks.LinearCEOptions(**{**VARIANTS[name][0]}).validated()
            acc = chunks.acc_dtype_for(dt, dt, o.dw_accum)
            row["chunk_rows"] = chunks.chunk_rows_for(n, d, v, acc, o)
        try:
            fn = _impl(name, compiled)

            def step(fn=fn) -> None:
                h.grad = None
                w.grad = None
                fn(h, w, y).backward()

            with _Config(name) if name in VARIANTS else contextlib.nullcontext():
                row["MiB"] = _peak_extra_mib(step)
                row["ms"] = _ms(step, rep)
            row["TFLOP/s"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            traceback.print_exc(limit=2)
        rows.append(row)
        if Setup.device == "cuda":
            torch.cuda.empty_cache()
    return rows


# --- 3. per-chunk breakdown -------------------------------------------------------------------


def breakdown(n: int, d: int, v: int, rep: int) -> dict[str, Any]:
    dt = torch.bfloat16
    rows = chunks.chunk_rows_for(n, d, v, torch.float32, chunks.LinearCEOptions())
    h = torch.randn(rows, d, device=Setup.device, dtype=dt)
    w = 0.02 * torch.randn(v, d, device=Setup.device, dtype=dt)
    y = torch.randint(0, v, (rows,), device=Setup.device)
    logits = torch.empty(rows, v, device=Setup.device, dtype=dt)
    loss = torch.empty(rows, device=Setup.device)
    scale = torch.tensor(1.0 / rows, device=Setup.device)
    dh = torch.empty(rows, d, device=Setup.device, dtype=dt)
    acc32 = torch.zeros(v, d, device=Setup.device)
    acc16 = torch.zeros(v, d, device=Setup.device, dtype=dt)
    torch.mm(h, w.t(), out=logits)
    fresh = logits.clone()
    parts: dict[str, Callable[[], Any]] = {
        "logits GEMM": lambda: torch.mm(h, w.t(), out=logits),
        "row kernel": lambda: (
            logits.copy_(fresh),
            kernels.launch_ce_rows(logits, y, loss, scale, -100, 0.0, True),
        ),
        "  (copy alone)": lambda: logits.copy_(fresh),
        "dh GEMM": lambda: torch.mm(logits, w, out=dh),
        "dW cuBLAS fp32-out": lambda: chunks._accumulate_dw(acc32, logits, h, False, True, "cublas", rows),
        "dW Triton GEMM": lambda: chunks._accumulate_dw(acc32, logits, h, False, True, "triton", rows),
        "dW cuBLAS bf16 (lean)": lambda: chunks._accumulate_dw(acc16, logits, h, False, True, "auto", rows),
    }
    out: dict[str, Any] = {"shape": f"{n}x{d} V={v}", "chunk_rows": rows, "chunks": -(-n // rows)}
    for name, fn in parts.items():
        try:
            out[name] = _ms(fn, rep)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:120]
    return out


# --- report -----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> None:
    console.print(
        f"{result['device']}, torch {result['torch']}, triton {result['triton']}, liger {result['liger']}; "
        f"cuBLAS fp32-out dW accumulation available: {result['cublas_fp32_out']}"
    )
    for c in result["checks"]:
        verdict = {True: "ok", False: "FAIL", None: "skip"}[c["passed"]]
        need = "" if c["required"] else " (informational)"
        console.print(f"check {verdict:4} {c['case']}{need} seed {c['seed']}: {c['detail']}", highlight=False)
    console.print(f"Triton fallbacks during the run (must be 0): {result['fallbacks']}")
    for b in result["breakdown"]:
        parts = ", ".join(f"{k} {_fmt(v, '.3f') if isinstance(v, float) else v}" for k, v in b.items())
        console.print(f"per chunk (ms): {parts}", highlight=False)
    table = Table(title="linear+CE forward+backward, bf16 (do_bench median; MiB = peak above inputs)")
    for col in ("shape", "impl", "chunk", "ms", "TFLOP/s", "MiB", "target", "note"):
        table.add_column(col, justify="right" if col in ("chunk", "ms", "TFLOP/s", "MiB") else "left")
    for r in result["timings"]:
        _, dv = r["shape"].split("x", 1)
        d, v = int(dv.split(" ")[0]), int(dv.split("=")[1])
        target = TARGETS.get((d, v))
        verdict = ""
        if target and r["ms"] is not None and r["impl"].startswith("hydra"):
            ok_t, ok_m = r["ms"] <= target[0], r["MiB"] is not None and r["MiB"] <= target[1]
            verdict = f"{'time ok' if ok_t else 'slow'}, {'mem ok' if ok_m else 'mem over'}"
        table.add_row(
            r["shape"],
            r["impl"],
            str(r.get("chunk_rows", "")),
            _fmt(r["ms"], ".2f"),
            _fmt(r.get("TFLOP/s"), ".0f"),
            _fmt(r["MiB"], ".0f"),
            verdict,
            r.get("error", "")[:50],
        )
    Console(width=max(console.width, 140)).print(table)
    console.print(
        "targets (docs/TARGETS.md): 16384x768 ≤ 7.46 ms and ≤ +25 MiB; 16384x2048 ≤ 44.4 ms and ≤ +125 MiB"
    )


def main(
    rep: Annotated[int, typer.Option("--rep", help="do_bench repetition time per measurement, ms.")] = 60,
    variants: Annotated[
        list[str] | None,
        typer.Option("--variant", help="Time only these implementations (repeatable); default all."),
    ] = None,
    skip_check: Annotated[bool, typer.Option("--skip-check", help="Skip the correctness pass.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON instead of tables.")] = False,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="Tiny shapes on the CPU interpreter: tries the script.")
    ] = False,
) -> None:
    """Check and time linear_cross_entropy variants against eager, torch.compile and Liger."""
    names = list(variants or [*VARIANTS, *PEERS])
    unknown = [n for n in names if n not in VARIANTS and n not in PEERS]
    if unknown:
        fail(f"unknown variant(s) {unknown}; choose from {[*VARIANTS, *PEERS]}", code=2)
    if smoke:
        Setup.use_smoke()
        names = [n for n in names if n != "torch.compile"]
    else:
        require_cuda("bench_linear_ce.py")
    hydra_kernels.reset_fallback_counts()
    checks = [] if skip_check else run_checks()
    timings, parts = [], []
    for n, d, v in Setup.shapes:
        if Setup.device == "cuda":
            try:
                parts.append(breakdown(n, d, v, rep))
            except Exception as exc:
                parts.append({"shape": f"{n}x{d} V={v}", "error": f"{type(exc).__name__}: {exc}"[:200]})
        timings += time_shape(n, d, v, names, rep)
    cublas = Setup.device == "cuda" and chunks._cublas_fp32_out_ok(
        torch.cuda.current_device(), torch.bfloat16
    )
    result = {
        "device": torch.cuda.get_device_name() if Setup.device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger": _liger_version(),
        "cublas_fp32_out": cublas,
        "checks": checks,
        "breakdown": parts,
        "timings": timings,
        "fallbacks": hydra_kernels.fallback_counts()[OP],
        "kernel_status": hydra_kernels.get_kernel_status()["ops"][OP],
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_linear_ce.json").write_text(json.dumps(result, indent=2, default=str))
    if as_json:
        emit_json(result)
    else:
        report(result)
    if any(c["required"] and c["passed"] is False for c in checks):
        fail("a required correctness check failed (listed above)")
    if result["fallbacks"]:
        fail(f"Triton kernels failed and fell back {result['fallbacks']} time(s); see the warnings")


if __name__ == "__main__":
    typer.run(main)
