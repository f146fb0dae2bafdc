"""Tuning harness for the norm kernels (RMSNorm, fused residual-add RMSNorm, QK-norm) on one GPU.

    python packages/hydra-diag/bench/bench_norms.py            # check + time, ~1-2 min on an H100
    python packages/hydra-diag/bench/bench_norms.py --sweep    # also sweep launch configs, ~+3 min

1. Correctness on CUDA: every output and gradient against an fp64 reference with the project
   criterion (hydra_kernels.numerics), at the bench shapes and at odd ones.
2. Forward+backward time (triton.testing.do_bench median) of hydra_kernels against torch eager,
   torch.compile and Liger-Kernel (when importable), with TB/s over the minimal bytes and the
   percentage of the device-to-device copy bandwidth this script measures itself. "hydra" is the
   public function (eager path), "hydra-op" the registered custom op with its autograd (what a
   compiled graph calls: shows the dispatcher's overhead), "hydra-compile" the public function
   under torch.compile; "fwd kernel"/"bwd kernels" time the raw launchers alone.
3. --sweep: launch configurations per shape (block_rows × num_warps, then programs per SM for the
   persistent backward), kernels alone; prints the best beside the current default.

A compact table goes to stdout; everything as JSON to $OUT/bench_norms.json when $OUT is set
(--json prints it instead). Exit 1 when a correctness check fails.
"""

import math
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

from hydra_kernels import launch_config
from hydra_kernels.bench_harness import copy_bandwidth_tbps, liger_peers, time_ms, wall_timer, write_report
from hydra_kernels.cli_support import console, emit_json, err_console, fail, require_cuda
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import qk_norm as qk_mod
from hydra_kernels.ops import rms_norm as rms_mod

DT = torch.bfloat16
EPS = 1e-6
OPS = ("rms_norm", "fused_add_rms_norm", "qk_norm")


class Setup:
    """Shapes and device; --smoke swaps in tiny shapes, any device and a wall-clock timer so the
    script itself can be tried on a CPU (TRITON_INTERPRET=1) before spending GPU time."""

    device = "cuda"
    smoke = False
    # the rows of docs/TARGETS.md
    rms_shapes: tuple[tuple[int, int], ...] = ((16384, 768), (16384, 2048), (16384, 4096))
    qk_shapes: tuple[tuple[int, ...], ...] = ((8, 2048, 6, 64), (8, 2048, 16, 128))  # presets' [B, S, H, d]
    check_rms: tuple[tuple[int, int], ...] = (
        (16384, 768),
        (16384, 4096),
        (1000, 200),
        (333, 96),
        (77, 12000),
    )
    check_qk: tuple[tuple[int, ...], ...] = ((8, 2048, 6, 64), (8, 2048, 16, 128), (3, 37, 5, 72))

    @classmethod
    def use_smoke(cls) -> None:
        cls.device = "cuda" if torch.cuda.is_available() else "cpu"
        cls.smoke = True
        cls.rms_shapes = cls.check_rms = ((37, 96),)
        cls.qk_shapes = cls.check_qk = ((2, 5, 3, 64),)


def _ms(fn: Callable[[], Any], rep: int) -> float:
    """hydra_kernels.bench_harness's do_bench median; under --smoke one wall-clock call."""
    return wall_timer(1)(fn) if Setup.smoke else time_ms(fn, rep)


def copy_tbps() -> float:
    """The device-to-device copy bandwidth (1 GiB; 128 KiB under --smoke)."""
    if Setup.smoke:
        return copy_bandwidth_tbps(torch.device(Setup.device), gib=2**-13, timer=wall_timer(1))
    return copy_bandwidth_tbps(torch.device(Setup.device))


def fwd_bwd(fn: Callable[..., Any], inputs: list[Any], grads_out: list[torch.Tensor]) -> Callable[[], None]:
    """Forward then backward of every output, gradients cleared first (as the targets are measured:
    docs/TARGETS.md)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step() -> None:
        for t in leaves:
            t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads_out[: len(outs)])

    return step


def _liger() -> dict[str, Callable[..., Any]]:
    """Liger's RMSNorm ("rms") and fused-add RMSNorm ("fused"), where importable."""
    found, info = liger_peers()
    if not found:
        err_console.print(f"Liger unavailable: {info}")
    names = {"rms": "rms_norm", "fused": "fused_add_rms_norm"}
    return {short: found[op] for short, op in names.items() if op in found}


# --- workloads -----------------------------------------------------------------------------------


def _rand(*shape: int, grad: bool = True, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.randn(*shape, device=Setup.device, dtype=dtype).requires_grad_(grad)


def _compile(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    return None if Setup.smoke else torch.compile(fn)


def workloads(liger: dict[str, Callable[..., Any]], only: set[str]) -> list[dict[str, Any]]:
    """Each: name, inputs, upstream grads, bytes, impls {name: fn}, raw fwd/bwd launcher closures."""
    out = []
    for n, d in Setup.rms_shapes if "rms_norm" in only else ():
        x, w, dy = _rand(n, d), _rand(d), _rand(n, d, grad=False)
        impls = {
            "hydra": lambda x, w: hydra_kernels.rms_norm(x, w, EPS),
            "hydra-op": lambda x, w: rms_mod._rms_norm_fwd_op(x, w, EPS),
            "hydra-compile": _compile(lambda x, w: hydra_kernels.rms_norm(x, w, EPS)),
            "eager": lambda x, w: rms_mod.rms_norm_ref(x, w, EPS),
            "compile": _compile(lambda x, w: rms_mod.rms_norm_ref(x, w, EPS)),
        }
        if "rms" in liger:
            impls["liger"] = liger["rms"]
        xd, wd = x.detach(), w.detach()
        out.append(
            {
                "op": "rms_norm",
                "shape": f"{n}x{d}",
                "inputs": [x, w],
                "grads_out": [dy],
                "bytes": 5 * n * d * 2,
                "impls": impls,
                "launch_op": "rms_norm",
                "width": d,
                "fwd": lambda xd=xd, wd=wd: rms_mod.rms_norm_fwd_launch(xd, None, wd, EPS),
                "bwd": lambda xd=xd, wd=wd, dy=dy: rms_mod.rms_norm_bwd_launch(dy, xd, wd, EPS, None),
            }
        )
    for n, d in Setup.rms_shapes if "fused_add_rms_norm" in only else ():
        x, r, w, dy, ds = _rand(n, d), _rand(n, d), _rand(d), _rand(n, d, grad=False), _rand(n, d, grad=False)
        impls = {
            "hydra": lambda x, r, w: hydra_kernels.fused_add_rms_norm(x, r, w, EPS),
            "eager": lambda x, r, w: rms_mod.fused_add_rms_norm_ref(x, r, w, EPS),
            "compile": _compile(lambda x, r, w: rms_mod.fused_add_rms_norm_ref(x, r, w, EPS)),
        }
        if "fused" in liger:
            impls["liger"] = liger["fused"]
        xd, rd, wd = x.detach(), r.detach(), w.detach()
        summed = xd + rd
        out.append(
            {
                "op": "fused_add_rms_norm",
                "shape": f"{n}x{d}",
                "inputs": [x, r, w],
                "grads_out": [dy, ds],
                # fwd: read x, r; write y, s. bwd: read dy, ds, s; write dx (dresidual is the same tensor)
                "bytes": 8 * n * d * 2,
                "impls": impls,
                "launch_op": "rms_norm",
                "width": d,
                "fwd": lambda xd=xd, rd=rd, wd=wd: rms_mod.rms_norm_fwd_launch(xd, rd, wd, EPS),
                "bwd": lambda s=summed, wd=wd, dy=dy, ds=ds: rms_mod.rms_norm_bwd_launch(dy, s, wd, EPS, ds),
            }
        )
    for shape in Setup.qk_shapes if "qk_norm" in only else ():
        d = shape[-1]
        for with_temp in (False, True):
            x, dy = _rand(*shape), _rand(*shape, grad=False)
            temp = (0.1 * torch.randn(shape[-2], device=Setup.device)).requires_grad_() if with_temp else None
            scale = math.sqrt(d)
            impls = {
                "hydra": lambda x, t, s=scale: hydra_kernels.qk_norm(x, s, t),
                "hydra-op": lambda x, t, s=scale: qk_mod._qk_norm_fwd_op(x, s, t),
                "eager": lambda x, t, s=scale: qk_mod.qk_norm_ref(x, s, t),
                "compile": _compile(lambda x, t, s=scale: qk_mod.qk_norm_ref(x, s, t)),
            }
            xd = x.detach()
            td = temp.detach() if temp is not None else None
            out.append(
                {
                    "op": "qk_norm" + ("+temp" if with_temp else ""),
                    "shape": "x".join(map(str, shape)),
                    "inputs": [x, temp],
                    "grads_out": [dy],
                    "bytes": 5 * x.numel() * 2,
                    "impls": impls,
                    "launch_op": "qk_norm",
                    "width": d,
                    "fwd": lambda xd=xd, td=td, s=scale: qk_mod.qk_norm_fwd_launch(xd, s, td),
                    "bwd": lambda xd=xd, td=td, s=scale, dy=dy: qk_mod.qk_norm_bwd_launch(dy, xd, s, td),
                }
            )
    return out


# --- correctness ---------------------------------------------------------------------------------


def _outputs_and_grads(fn, inputs, grads_out):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, grads_out, strict=False))
    return [*outs, *torch.autograd.grad(loss, leaves)]


def check_case(
    name: str, fn, ref, inputs: list[Any], grads_out: list[torch.Tensor], reduction: str
) -> list[dict]:
    as64 = [
        t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in inputs
    ]
    kernel = _outputs_and_grads(fn, inputs, grads_out)
    same = _outputs_and_grads(ref, inputs, grads_out)
    ref64 = _outputs_and_grads(ref, as64, grads_out)
    rows = []
    for i, (k, t, r) in enumerate(zip(kernel, same, ref64, strict=True)):
        res = check_against_fp64(k, t, r, atol=fp32_noise_atol(r), reduction=reduction)
        rows.append(
            {
                "case": name,
                "tensor": i,
                "passed": res.passed,
                "worst_ratio": res.worst_ratio,
                "detail": res.describe(),
            }
        )
    return rows


def run_checks(only: set[str]) -> list[dict]:
    rows: list[dict] = []
    cases = []
    for n, d in Setup.check_rms if only & {"rms_norm", "fused_add_rms_norm"} else ():
        for dt in (torch.bfloat16, torch.float32):
            x, w, dy = _rand(n, d, dtype=dt), _rand(d, dtype=dt), _rand(n, d, grad=False, dtype=dt)
            cases.append(
                (
                    f"rms_norm {n}x{d} {dt}",
                    hydra_kernels.rms_norm,
                    rms_mod.rms_norm_ref,
                    [x, w],
                    [dy],
                    "elementwise",
                )
            )
            r, ds = _rand(n, d, dtype=dt), _rand(n, d, grad=False, dtype=dt)
            red = "elementwise" if dt == torch.float32 else "max"  # see numerics: the op rounds x + r
            cases.append(
                (
                    f"fused_add {n}x{d} {dt}",
                    hydra_kernels.fused_add_rms_norm,
                    rms_mod.fused_add_rms_norm_ref,
                    [x, r, w],
                    [dy, ds],
                    red,
                )
            )
    for shape in Setup.check_qk if "qk_norm" in only else ():
        for dt in (torch.bfloat16, torch.float32):
            x, dy = _rand(*shape, dtype=dt), _rand(*shape, grad=False, dtype=dt)
            temp = (0.3 * torch.randn(shape[-2], device=Setup.device)).requires_grad_()
            s = math.sqrt(shape[-1])
            cases.append(
                (
                    f"qk_norm {shape} {dt}",
                    lambda x, t, s=s: hydra_kernels.qk_norm(x, s, t),
                    lambda x, t, s=s: qk_mod.qk_norm_ref(x, s, t),
                    [x, temp],
                    [dy],
                    "elementwise",
                )
            )
    for name, fn, ref, inputs, grads_out, red in cases:
        try:
            rows += check_case(name, fn, ref, inputs, grads_out, red)
        except Exception as exc:
            rows.append(
                {
                    "case": name,
                    "tensor": None,
                    "passed": False,
                    "worst_ratio": None,
                    "detail": f"{type(exc).__name__}: {exc}",
                }
            )
    return rows


# --- timing and sweeps ---------------------------------------------------------------------------


def time_workload(wl: dict[str, Any], copy: float, rep: int) -> list[dict]:
    rows = []
    variants = {name: fwd_bwd(fn, wl["inputs"], wl["grads_out"]) for name, fn in wl["impls"].items() if fn}
    variants["fwd kernel"] = wl["fwd"]
    variants["bwd kernels"] = wl["bwd"]
    for name, step in variants.items():
        row = {"op": wl["op"], "shape": wl["shape"], "impl": name, "ms": None, "TB/s": None, "%copy": None}
        try:
            row["ms"] = _ms(step, rep)
            if name not in ("fwd kernel", "bwd kernels"):  # byte floors are for fwd+bwd
                row["TB/s"] = wl["bytes"] / (row["ms"] * 1e-3) / 1e12
                row["%copy"] = 100 * row["TB/s"] / copy
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            traceback.print_exc(limit=2)
        rows.append(row)
    return rows


def _candidates(width: int, qk: bool) -> list[tuple[int, int]]:
    """(block_rows, num_warps) pairs giving 8-32 elements per thread (2-4 16-byte bf16 vectors)."""
    block_d = 1 << (width - 1).bit_length()
    pairs = []
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for warps in (1, 2, 4, 8, 16):
            per_thread = rows * block_d / (32 * warps)
            if 8 <= per_thread <= 32 and (qk or rows <= 16):
                pairs.append((rows, warps))
    return pairs


def _time_config(key: str, step: Callable[[], Any], rep: int, **fields: int) -> float:
    launch_config.set_launch_overrides(key, **fields)
    try:
        return _ms(step, rep)
    except Exception as exc:  # e.g. too many registers or too much shared memory: not a candidate
        err_console.print(f"  {key} {fields}: {type(exc).__name__}: {str(exc)[:120]}")
        return float("inf")
    finally:
        launch_config.clear_launch_overrides()


def sweep_workload(wl: dict[str, Any], rep: int) -> dict[str, Any]:
    """Forward: block_rows × num_warps. Backward: the same, then num_stages of its row loop with
    the best pair, then programs per SM with the best triple. Kernels alone, no autograd."""
    op = wl["launch_op"]
    pps_table = (rms_mod if op == "rms_norm" else qk_mod).BWD_PROGRAMS_PER_SM
    gen = launch_config.gpu_generation(torch.device(Setup.device))
    result: dict[str, Any] = {"op": wl["op"], "shape": wl["shape"]}
    for stage, key in (("fwd", op), ("bwd", op + "_bwd")):
        step = wl[stage]
        timings = {
            (rows, warps): _time_config(key, step, rep, block_rows=rows, num_warps=warps)
            for rows, warps in _candidates(wl["width"], op == "qk_norm")
        }
        rows, warps = min(timings, key=timings.get)
        entry = {
            "default_ms": _ms(step, rep),
            "best": {"block_rows": rows, "num_warps": warps},
            "best_ms": timings[(rows, warps)],
            "all": {f"{r}x{w}": t for (r, w), t in timings.items()},
        }
        if stage == "bwd":
            by_stages = {
                n: _time_config(key, step, rep, block_rows=rows, num_warps=warps, num_stages=n)
                for n in (1, 2, 3, 4)
            }
            stages = min(by_stages, key=by_stages.get)
            entry["num_stages_ms"] = by_stages
            saved = dict(pps_table)
            per_sm = {}
            try:
                for pps in (1, 2, 3, 4, 8):
                    pps_table[gen] = pps
                    per_sm[pps] = _time_config(
                        key, step, rep, block_rows=rows, num_warps=warps, num_stages=stages
                    )
            finally:
                pps_table.clear()
                pps_table.update(saved)
            entry["programs_per_sm_ms"] = per_sm
            entry["best"] = {
                "block_rows": rows,
                "num_warps": warps,
                "num_stages": stages,
                "programs_per_sm": min(per_sm, key=per_sm.get),
            }
            entry["best_ms"] = min(per_sm.values())
        result[stage] = entry
    return result


# --- report --------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _device_name() -> str:
    return torch.cuda.get_device_name() if Setup.device == "cuda" else "cpu (Triton interpreter)"


def report(copy: float, checks: list[dict], timings: list[dict], sweeps: list[dict], fallbacks: dict) -> None:
    dev = _device_name()
    console.print(
        f"{dev}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
        f"copy bandwidth {copy:.2f} TB/s (read+write)"
    )
    failed = [c for c in checks if not c["passed"]]
    console.print(f"correctness: {len(checks) - len(failed)}/{len(checks)} tensors pass the fp64 criterion")
    for c in failed:
        console.print(f"  FAIL {c['case']} tensor {c['tensor']}: {c['detail']}")
    console.print(f"Triton fallbacks during the run (must be 0): {fallbacks}")
    table = Table(title="forward+backward, bf16 (do_bench median)")
    for col in ("op", "shape", "impl", "ms", "TB/s", "% copy", "note"):
        table.add_column(col, justify="right" if col in ("ms", "TB/s", "% copy") else "left")
    for r in timings:
        table.add_row(
            r["op"],
            r["shape"],
            r["impl"],
            _fmt(r["ms"], ".4f"),
            _fmt(r["TB/s"], ".2f"),
            _fmt(r["%copy"], ".0f"),
            r.get("error", "")[:60],
        )
    wide = Console(width=max(console.width, 150))  # a narrow pipe would squeeze the columns
    wide.print(table)
    for s in sweeps:
        f, b = s["fwd"], s["bwd"]
        wide.print(
            f"sweep {s['op']} {s['shape']}: fwd default {f['default_ms']:.4f} "
            f"best {f['best_ms']:.4f} {f['best']}; bwd default {b['default_ms']:.4f} "
            f"best {b['best_ms']:.4f} {b['best']}; stages "
            + ", ".join(f"{k}:{v:.4f}" for k, v in b["num_stages_ms"].items())
            + "; programs per SM "
            + ", ".join(f"{k}:{v:.4f}" for k, v in b["programs_per_sm_ms"].items())
        )


def main(
    sweep: Annotated[bool, typer.Option("--sweep", help="Also sweep launch configurations.")] = False,
    rep: Annotated[int, typer.Option("--rep", help="do_bench repetition time per measurement, ms.")] = 100,
    skip_check: Annotated[bool, typer.Option("--skip-check", help="Skip the correctness pass.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON instead of tables.")] = False,
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help=f"Restrict to these ops (repeatable): {', '.join(OPS)}."),
    ] = None,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="Tiny shapes on any device, wall-clock timing: tries the script.")
    ] = False,
) -> None:
    """Check and time the norm kernels on this GPU against eager, torch.compile and Liger."""
    chosen = set(only or OPS)
    if chosen - set(OPS):
        fail(f"unknown op(s) {sorted(chosen - set(OPS))}; choose from {', '.join(OPS)}", code=2)
    if smoke:
        Setup.use_smoke()
    else:
        require_cuda("bench_norms.py")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    hydra_kernels.reset_fallback_counts()
    copy = copy_tbps()
    checks = [] if skip_check else run_checks(chosen)
    liger = _liger()
    timings, sweeps = [], []
    for wl in workloads(liger, chosen):
        timings += time_workload(wl, copy, rep)
        if sweep and wl["op"] in ("rms_norm", "qk_norm+temp"):
            try:
                sweeps.append(sweep_workload(wl, max(20, rep // 4)))
            except Exception as exc:
                err_console.print(f"sweep {wl['op']} {wl['shape']} failed: {type(exc).__name__}: {exc}")
        if Setup.device == "cuda":
            torch.cuda.empty_cache()
    fallbacks = {op: n for op, n in hydra_kernels.fallback_counts().items() if op in ("rms_norm", "qk_norm")}
    result = {
        "device": _device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_tbps": copy,
        "checks": checks,
        "timings": timings,
        "sweeps": sweeps,
        "kernel_status": hydra_kernels.get_kernel_status(),
    }
    if os.environ.get("OUT"):
        write_report(result, Path(os.environ["OUT"]) / "bench_norms.json")
    if as_json:
        emit_json(result)
    else:
        report(copy, checks, timings, sweeps, fallbacks)
    if any(not c["passed"] for c in checks):
        fail("some kernel outputs or gradients fail the fp64 criterion (listed above)")
    if any(fallbacks.values()):
        fail(f"Triton kernels failed and fell back to the reference: {fallbacks} (see the warnings)")


if __name__ == "__main__":
    typer.run(main)
