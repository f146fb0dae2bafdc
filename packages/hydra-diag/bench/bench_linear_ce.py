"""linear_cross_entropy on one GPU against its peers: correctness, time and memory (issue 13).

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/bench_linear_ce.py --out $OUT/bench_linear_ce.json
    python packages/hydra-diag/bench/bench_linear_ce.py --smoke  # tiny shapes, CPU interpreter

1. Correctness on the device against float64 (the project criterion plus the op's allowance
   grad_rounding_atol): the old scheme (``dw_accum="fp32"``) and the new one (``"compensated"``)
   at N=1537, D=320, V=5003 (a fifth of the targets ignored, z-loss), and 64 chunks of 256 tokens
   at N=16384, D=768, V=8192, where bf16 accumulation (``"input"``) is shown failing.
2. Per-chunk breakdown of the compensated scheme's automatic chunk at each shape.
3. Forward + backward (bf16, mean) at 16384×768 V=32000 / V=50304 and 16384×2048 V=128256 for
   torch eager, torch.compile, Liger (bf16 and fp32 accumulation; a note when not importable)
   and the hydra schemes: ``do_bench`` median, and memory: ``over inputs`` = max_memory_allocated
   during a step minus what was allocated before it (the inputs: the previous gradients are
   freed first); ``workspace`` = that minus the returned gradients (what Liger's +25 MiB counts).
   Issue 13's targets: time ≤ torch.compile's, workspace ≤ 2 × Liger's, in the same run.

Each implementation runs on its own copy of the inputs (Liger's backward writes over its saved
inputs). JSON to ``--out`` (and ``$OUT/bench_linear_ce.json`` when $OUT is set); the table comes
last. Exit 1 when a required check fails or a Triton kernel fell back.
"""

import contextlib
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

from hydra_kernels.bench_harness import time_ms, wall_timer, write_report
from hydra_kernels.cli_support import console, emit_json, fail, require_cuda
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import _linear_ce_chunks as chunks
from hydra_kernels.ops import _linear_ce_compensated as comp
from hydra_kernels.ops import _linear_ce_kernels as kernels
from hydra_kernels.ops import linear_cross_entropy as lce
from hydra_kernels.ops._linear_ce_liger import _liger as liger_import
from hydra_kernels.ops._linear_ce_liger import positional_args

OP = "linear_cross_entropy"
PEERS = ("torch eager", "torch.compile", "liger", "liger fp32-acc")


def _budget_rows(n: int, d: int, v: int) -> int:
    """Rows of bf16 logits that fit twice Liger's chunk beside the per-token losses (no plane)."""
    return comp.compensated_chunk_rows(n, d, v, 2, need_dw=False)


#: hydra variants: name -> shape -> set_linear_ce_options kwargs.
VARIANTS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "hydra fp32 (old default)": lambda n, d, v: {"dw_accum": "fp32"},
    "hydra compensated": lambda n, d, v: {"dw_accum": "compensated"},
    "hydra compensated c1024": lambda n, d, v: {"dw_accum": "compensated", "chunk_rows": 1024},
    "hydra compensated c2048": lambda n, d, v: {"dw_accum": "compensated", "chunk_rows": 2048},
    "hydra compensated c4096": lambda n, d, v: {"dw_accum": "compensated", "chunk_rows": 4096},
    "hydra input 2xLiger": lambda n, d, v: {"dw_accum": "input", "chunk_rows": _budget_rows(n, d, v)},
}


class Setup:
    device = "cuda"
    smoke = False
    shapes: tuple[tuple[int, int, int], ...] = (
        (16384, 768, 32000),
        (16384, 768, 50304),
        (16384, 2048, 128256),
    )
    check_shape = (1537, 320, 5003)
    many_chunks = (16384, 768, 8192, 256)  # N, D, V, chunk rows

    @classmethod
    def use_smoke(cls) -> None:
        cls.device, cls.smoke = "cpu", True
        cls.shapes = ((96, 48, 301),)
        cls.check_shape = (37, 48, 301)
        cls.many_chunks = (64, 32, 128, 4)


def _sync() -> None:
    if Setup.device == "cuda":
        torch.cuda.synchronize()


def _ms(fn: Callable[[], Any], rep: int) -> float:
    """hydra_kernels.bench_harness's do_bench median; under --smoke one wall-clock call (it only
    shows that the script runs)."""
    return wall_timer(1)(fn) if Setup.smoke else time_ms(fn, rep)


def _liger_fn():
    """Liger's autograd.Function, or None where it is not importable."""
    found = liger_import()
    return found[0] if found else None


@contextlib.contextmanager
def _options(values: dict[str, Any]):
    lce.set_linear_ce_options(**values)
    try:
        yield
    finally:
        lce.reset_linear_ce_options()


# --- 1. correctness ---------------------------------------------------------------------------


def _outputs(fn, h, w, y, dtype, reduction, z_loss, g):
    hh = h.detach().to(dtype, copy=True).requires_grad_()  # fresh leaves: no shared .grad
    ww = w.detach().to(dtype, copy=True).requires_grad_()
    out = fn(hh, ww, y, -100, reduction, z_loss)
    (out * g.to(out.dtype)).sum().backward()
    return out.detach(), hh.grad, ww.grad


def _criterion(got, same, ref, extra) -> tuple[bool, str]:
    atol = fp32_noise_atol(ref) + extra
    if isinstance(atol, torch.Tensor):  # elementwise atol: divide everything by it (same criterion)
        res = check_against_fp64(got.double() / atol, same.double() / atol, ref / atol, 1.0)
    else:
        res = check_against_fp64(got, same, ref, atol)
    return res.passed, f"{res.worst_ratio:.3g}"


def _check_case(shape, name, opts, dtype, reduction, z_loss, required, seed) -> dict[str, Any]:
    n, d, v = shape
    row = {"case": f"{name} {str(dtype)[6:]} {reduction} z={z_loss} N={n} D={d} V={v}", "required": required}
    gen = torch.Generator(device=Setup.device).manual_seed(seed)
    h = torch.randn(n, d, generator=gen, device=Setup.device, dtype=torch.float64)
    w = 0.05 * torch.randn(v, d, generator=gen, device=Setup.device, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=gen, device=Setup.device)
    y[torch.rand(n, generator=gen, device=Setup.device) < 0.2] = -100
    g = torch.linspace(-1, 2, n, device=Setup.device, dtype=torch.float64)
    g = g if reduction == "none" else torch.tensor(1.0, device=Setup.device, dtype=torch.float64)
    try:
        with _options(opts):
            got = _outputs(lce.linear_cross_entropy, h, w, y, dtype, reduction, z_loss, g)
        same = _outputs(lce.linear_cross_entropy_ref, h, w, y, dtype, reduction, z_loss, g)
        ref = _outputs(lce.linear_cross_entropy_ref, h, w, y, torch.float64, reduction, z_loss, g)
        flips = lce.grad_rounding_atol(h, w, y, dtype, -100, reduction, z_loss, g)
        verdicts = [_criterion(got[0], same[0], ref[0], 0.0)]
        verdicts += [
            _criterion(k, t, r, e) for k, t, r, e in zip(got[1:], same[1:], ref[1:], flips, strict=True)
        ]
        row["passed"] = all(ok for ok, _ in verdicts)
        row["detail"] = "worst ratio " + ", ".join(
            f"{t} {msg}" for t, (_, msg) in zip(("loss", "dh", "dW"), verdicts, strict=True)
        )
    except Exception as exc:
        row.update(passed=False, detail=f"{type(exc).__name__}: {exc}"[:300])
    return row


def run_checks(seed: int) -> list[dict[str, Any]]:
    bf, f32 = torch.bfloat16, torch.float32
    n, d, v, c = Setup.many_chunks
    cases = [  # shape, dw_accum, chunk rows (0: automatic), dtype, reduction, z-loss, required
        (Setup.check_shape, "fp32", 0, bf, "mean", 1e-3, True),
        (Setup.check_shape, "compensated", 0, bf, "mean", 1e-3, True),
        (Setup.check_shape, "compensated", 0, bf, "none", 1e-3, True),
        (Setup.check_shape, "compensated", 0, f32, "sum", 0.0, True),
        ((n, d, v), "compensated", c, bf, "mean", 0.0, True),
        ((n, d, v), "fp32", c, bf, "mean", 0.0, True),
        ((n, d, v), "input", c, bf, "mean", 0.0, False),
    ]
    out = []
    for shape, mode, rows, dtype, reduction, z_loss, required in cases:
        name = mode + (" (old)" if mode == "fp32" else "") + (f" c{rows}" if rows else "")
        opts = {"dw_accum": mode, "chunk_rows": rows}
        out.append({**_check_case(shape, name, opts, dtype, reduction, z_loss, required, seed), "seed": seed})
        if Setup.device == "cuda":
            torch.cuda.empty_cache()
    return out


# --- 2. per-chunk breakdown -------------------------------------------------------------------


def breakdown(n: int, d: int, v: int, rep: int) -> dict[str, Any]:
    dt, dev = torch.bfloat16, Setup.device
    rows = comp.compensated_chunk_rows(n, d, v, 2, need_dw=True)
    h = torch.randn(rows, d, device=dev, dtype=dt)
    w = 0.02 * torch.randn(v, d, device=dev, dtype=dt)
    y = torch.randint(0, v, (rows,), device=dev)
    logits = torch.empty(rows, v, device=dev, dtype=dt)
    loss = torch.empty(rows, device=dev)
    scale = torch.tensor(1.0 / n, device=dev)
    dh = torch.empty(rows, d, device=dev, dtype=dt)
    dw = torch.zeros(v, d, device=dev, dtype=dt)
    plane = torch.zeros(comp.plane_shape(v, d), device=dev, dtype=torch.uint8)
    acc32 = torch.zeros(v, d, device=dev)
    torch.mm(h, w.t(), out=logits)
    kernels.launch_ce_rows(logits, y, loss, scale, -100, 0.0, True)  # a realistic gradient
    grad = logits.clone()
    parts: dict[str, Callable[[], Any]] = {
        "logits GEMM": lambda: torch.mm(h, w.t(), out=logits),
        "row kernel (incl. a copy)": lambda: (
            logits.copy_(grad),
            kernels.launch_ce_rows(logits, y, loss, scale, -100, 0.0, True),
        ),
        "copy alone": lambda: logits.copy_(grad),
        "dh GEMM": lambda: torch.mm(grad, w, out=dh),
        "dW compensated (Triton)": lambda: comp.accumulate_compensated(dw, plane, grad, h, False, True, rows),
        "dW cuBLAS bf16 accumulate": lambda: dw.addmm_(grad.t(), h),
        "dW cuBLAS fp32-out accumulate": lambda: chunks._accumulate_dw(
            acc32, grad, h, False, True, "cublas", rows
        ),
    }
    out: dict[str, Any] = {"shape": f"{n}x{d} V={v}", "chunk_rows": rows, "chunks": -(-n // rows)}
    for name, fn in parts.items():
        try:
            out[name] = _ms(fn, rep)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:120]
    return out


# --- 3. time and memory -----------------------------------------------------------------------


def _impl(name: str, compiled: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    ref = lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y)
    if name in VARIANTS:
        return lambda h, w, y: lce.linear_cross_entropy(h, w, y)
    if name == "torch eager":
        return ref
    if name == "torch.compile":
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(ref, dynamic=False)
        return compiled["fn"]
    fn = _liger_fn()
    if fn is None:
        raise ModuleNotFoundError("liger_kernel is not importable here: Liger skipped")
    if name == "liger":
        return lambda h, w, y: fn.apply(h, w, y)[0]
    args = {"_input": None, "weight": None, "target": None, "accum_dtype": torch.float32}
    order = positional_args(fn.forward, args)  # raises if this Liger has no accum_dtype
    return lambda h, w, y: fn.apply(h, w, y, *order[3:])[0]


class _Step:
    """One forward + backward of ``fn`` on private leaves (gradients cleared first)."""

    def __init__(self, fn: Callable[..., Any], h: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        self.fn, self.y = fn, y
        self.h = h.clone().requires_grad_()  # a private copy: Liger writes over its saved inputs
        self.w = w.clone().requires_grad_()

    def clear(self) -> None:
        self.h.grad = None
        self.w.grad = None

    def __call__(self) -> None:
        self.clear()
        self.fn(self.h, self.w, self.y).backward()

    def grad_bytes(self) -> int:
        return sum(t.grad.numel() * t.grad.element_size() for t in (self.h, self.w) if t.grad is not None)


def _memory_mib(step: _Step) -> tuple[float | None, float | None]:
    """(peak above the inputs, that minus the returned gradients), MiB, of one warm step: the
    previous gradients are freed before the base is read."""
    if Setup.device != "cuda":
        return None, None
    step()
    _sync()
    step.clear()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    _sync()
    over = torch.cuda.max_memory_allocated() - base
    return over / 2**20, (over - step.grad_bytes()) / 2**20


def _measure(row: dict[str, Any], step: _Step, opts: dict[str, Any], rep: int) -> None:
    n, d = step.h.shape
    v = step.w.shape[0]
    with _options(opts):
        row["over_inputs_mib"], row["workspace_mib"] = _memory_mib(step)
        row["ms"] = _ms(step, rep)
    row["TFLOP/s"] = 6.0 * n * d * v / (row["ms"] * 1e-3) / 1e12


def time_shape(n: int, d: int, v: int, names: list[str], rep: int) -> list[dict[str, Any]]:
    dt, dev = torch.bfloat16, Setup.device
    h = torch.randn(n, d, device=dev, dtype=dt)
    w = 0.02 * torch.randn(v, d, device=dev, dtype=dt)
    y = torch.randint(0, v, (n,), device=dev)
    compiled: dict[str, Callable[..., Any]] = {}
    out = []
    for name in names:
        row: dict[str, Any] = {"shape": f"{n}x{d} V={v}", "impl": name}
        opts = VARIANTS[name](n, d, v) if name in VARIANTS else {}
        if name in VARIANTS:
            o = chunks.LinearCEOptions(**opts).validated()
            acc = chunks.acc_dtype_for(dt, dt, o.dw_accum)
            row["chunk_rows"] = chunks.chunk_rows_for(n, d, v, acc, o, 2, True)
            if o.dw_accum == "compensated":
                ws = comp.workspace_bytes(n, d, v, 2, row["chunk_rows"], True)
                row["predicted_workspace_mib"] = ws / 2**20
        try:
            _measure(row, _Step(_impl(name, compiled), h, w, y), opts, rep)
        except ModuleNotFoundError as exc:
            row["note"] = str(exc)
            console.print(f"note: {exc}", highlight=False)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            traceback.print_exc(limit=2)
        out.append(row)
        if dev == "cuda":
            torch.cuda.empty_cache()
    _targets(out)
    return out


def _targets(rows: list[dict[str, Any]]) -> None:
    """Issue 13's two targets for every hydra row: time ≤ compile's, workspace ≤ 2 × Liger's."""
    by = {r["impl"]: r for r in rows}
    compile_ms = by.get("torch.compile", {}).get("ms")
    liger_ws = by.get("liger", {}).get("workspace_mib")
    for r in rows:
        if r["impl"] in VARIANTS and r.get("ms"):
            r["time_vs_compile"] = r["ms"] / compile_ms if compile_ms else None
            ws = r.get("workspace_mib")
            r["workspace_vs_liger"] = ws / liger_ws if ws is not None and liger_ws else None


# --- report -----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> None:
    console.print(
        f"{result['device']}, torch {result['torch']}, triton {result['triton']}, liger {result['liger']}",
        highlight=False,
    )
    for c in result["checks"]:
        verdict = {True: "ok", False: "FAIL"}[c["passed"]]
        need = "" if c["required"] else " (informational)"
        console.print(f"check {verdict:4} {c['case']}{need}: {c['detail']}", highlight=False)
    console.print(f"Triton fallbacks during the run (must be 0): {result['fallbacks']}")
    for b in result["breakdown"]:
        parts = ", ".join(f"{k} {_fmt(v, '.3f') if isinstance(v, float) else v}" for k, v in b.items())
        console.print(f"per chunk (ms): {parts}", highlight=False)
    table = Table(title="linear+CE fwd+bwd, bf16, mean (do_bench median; MiB: peak above inputs / workspace)")
    for col in (
        "shape",
        "impl",
        "rows",
        "ms",
        "TFLOP/s",
        "MiB over inputs",
        "workspace",
        "pred.",
        "vs compile",
        "vs Liger",
    ):
        table.add_column(col, justify="left" if col in ("shape", "impl") else "right")
    for r in result["timings"]:
        table.add_row(
            r["shape"],
            r["impl"],
            str(r.get("chunk_rows", "")),
            _fmt(r.get("ms"), ".2f"),
            _fmt(r.get("TFLOP/s"), ".0f"),
            _fmt(r.get("over_inputs_mib"), ".1f"),
            _fmt(r.get("workspace_mib"), ".1f"),
            _fmt(r.get("predicted_workspace_mib"), ".1f"),
            _fmt(r.get("time_vs_compile"), ".3f"),
            _fmt(r.get("workspace_vs_liger"), ".2f"),
        )
    Console(width=max(console.width, 150)).print(table)
    console.print("targets (issue 13): vs compile ≤ 1.000 (time) and vs Liger ≤ 2.00 (workspace)")


def main(
    rep: Annotated[int, typer.Option("--rep", help="do_bench repetition time per measurement, ms.")] = 100,
    out: Annotated[Path | None, typer.Option("--out", help="Write the JSON report here.")] = None,
    variants: Annotated[
        list[str] | None, typer.Option("--variant", help="Time only these implementations (repeatable).")
    ] = None,
    skip_check: Annotated[bool, typer.Option("--skip-check", help="Skip the correctness pass.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON instead of tables.")] = False,
    smoke: Annotated[bool, typer.Option("--smoke", help="Tiny shapes on the CPU interpreter.")] = False,
) -> None:
    """Check and time linear_cross_entropy's schemes against eager, torch.compile and Liger."""
    names = list(variants or [*PEERS, *VARIANTS])
    unknown = [n for n in names if n not in VARIANTS and n not in PEERS]
    if unknown:
        fail(f"unknown variant(s) {unknown}; choose from {[*PEERS, *VARIANTS]}", code=2)
    if smoke:
        Setup.use_smoke()
        names = [n for n in names if n != "torch.compile"]
    else:
        require_cuda("bench_linear_ce.py")
    hydra_kernels.reset_fallback_counts()
    seed = int.from_bytes(os.urandom(4), "little")
    checks = [] if skip_check else run_checks(seed)
    timings, parts = [], []
    for n, d, v in Setup.shapes:
        if Setup.device == "cuda":
            try:
                parts.append(breakdown(n, d, v, rep))
            except Exception as exc:
                parts.append({"shape": f"{n}x{d} V={v}", "error": f"{type(exc).__name__}: {exc}"[:200]})
        timings += time_shape(n, d, v, names, rep)
    result = {
        "device": torch.cuda.get_device_name() if Setup.device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "liger": ".".join(map(str, liger_import()[2])) if liger_import() else None,
        "checks": checks,
        "breakdown": parts,
        "timings": timings,
        "fallbacks": hydra_kernels.fallback_counts()[OP],
    }
    for path in (out, Path(os.environ["OUT"], "bench_linear_ce.json") if os.environ.get("OUT") else None):
        if path is not None:
            write_report(result, path)
    if as_json:
        emit_json(result)
    else:
        report(result)
    if any(c["required"] and not c["passed"] for c in checks):
        fail("a required correctness check failed (listed above)")
    if result["fallbacks"]:
        fail(f"Triton kernels failed and fell back {result['fallbacks']} time(s); see the warnings")


if __name__ == "__main__":
    typer.run(main)
