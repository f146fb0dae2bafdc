"""Where an eager forward+backward spends its time, and which launch configurations and linear+CE
schemes are fastest: one GPU, one call, a few minutes on an H100.

    python packages/hydra-diag/bench/tune.py                    # every section
    python packages/hydra-diag/bench/tune.py --section host --section lce

Sections (each row is also written to $OUT/tune.json as soon as it is measured, so a run cut
short still returns what it got):

- ``host``: host microseconds per call with the GPU idle — a bare Triton launch, a bare aten op,
  and one eager forward+backward of each op (hydra, torch.compile, Liger) at a small shape. At the
  benchmark shapes the GPU work of a norm or an activation is 20-300 µs, so this is the budget
  that decides whether an eager call is GPU-bound.
- ``ops``: ``hydra_kernels.bench.run_bench`` on the norm, activation and rotary ops (fwd+bwd
  median against eager, torch.compile and Liger, plus a CUDA-graph replay of the hydra and
  compile steps: the GPU's own time); ``opshost``: the host time of each hydra step at those
  shapes.
- ``sweep``: GPU time (CUDA-graph replay, no host work) of each op's forward and backward
  launchers under candidate launch configurations, beside the table default.
- ``lce``: linear+CE schemes (fp32 accumulator at several chunk sizes, the slab scheme, the lean
  mode) against torch.compile and Liger at docs/TARGETS.md's two shapes: ms and peak extra MiB; plus a
  correctness check of each scheme on CUDA at an odd shape.
"""

import json
import os
import sys
import time
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

import triton
import triton.language as tl
from rich.console import Console

from hydra_kernels import bench, launch_config
from hydra_kernels import bench_harness as harness
from hydra_kernels.cli_support import require_cuda
from hydra_kernels.ops import linear_cross_entropy as lce
from hydra_kernels.ops import qk_norm as qk_mod
from hydra_kernels.ops import rms_norm as rms_mod
from hydra_kernels.ops import rope as rope_mod
from hydra_kernels.ops import swiglu as sw_mod

SECTIONS = ("host", "ops", "opshost", "lce", "sweep")
out = Console(width=160)
RESULT: dict[str, Any] = {"rows": []}


def record(section: str, **row: Any) -> None:
    row = {"section": section, **row}
    RESULT["rows"].append(row)
    shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    out.print(shown, highlight=False)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tune.json").write_text(json.dumps(RESULT, indent=1, default=str))


def host_us(step: Callable[[], Any], calls: int = 50) -> float:
    """Host microseconds per call, GPU left to run behind (few enough calls not to fill the
    launch queue)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def ms(fn: Callable[[], Any], rep: int = 60) -> float:
    return harness.time_ms(fn, rep=rep)


@triton.jit
def _noop_kernel(a, b, c, d, n, s0, s1, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if FLAG:
        tl.store(a + offs, tl.load(b + offs, mask=offs < n) * eps, mask=offs < n)


# --- host -------------------------------------------------------------------------------------


def section_host() -> None:
    dev = torch.device("cuda")
    a = torch.randn(256, device=dev)
    b = torch.randn(256, device=dev)
    record(
        "host",
        what="triton launch (10 args)",
        us=host_us(lambda: _noop_kernel[(1,)](a, b, a, b, 256, 256, 1, 1.0, BLOCK=256, FLAG=True), 200),
    )
    compiled = _noop_kernel[(1,)](a, b, a, b, 256, 256, 1, 1.0, BLOCK=256, FLAG=True)
    args = (a, b, a, b, 256, 256, 1, 1.0, 256, True)
    try:  # the compiled kernel called directly: what JITFunction.run adds on top of the launch
        record(
            "host",
            what="compiled-kernel launch (10 args)",
            us=host_us(lambda: compiled[(1, 1, 1)](*args), 200),
        )
    except Exception as exc:
        record("host", what="compiled-kernel launch", error=f"{type(exc).__name__}: {exc}"[:160])
    record("host", what="torch.empty", us=host_us(lambda: torch.empty(256, device=dev), 200))
    record("host", what="aten mul", us=host_us(lambda: a.mul(2.0), 200))
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    g = torch.randn(64, 256, device=dev)
    record("host", what="autograd mul fwd+bwd", us=host_us(harness.fwd_bwd_step(lambda t: t * 2.0, [x], g)))
    small = {"rms_norm": 768, "fused_add_rms_norm": 768, "swiglu": 2048, "qk_norm": 64, "rope": 64}
    liger, info = harness.liger_peers()
    why = None if liger else info  # a version string is no reason
    for op in small:
        for w in bench._workloads(op, dev, torch.bfloat16, liger, why):
            if op in ("qk_norm", "rope"):  # shrink [B, S, H, D] to 64 tokens
                x0 = w.inputs[0]
                x1 = x0.detach()[:1, :64].clone().requires_grad_()
                w.inputs = [x1, *(t[:64] if op == "rope" else t for t in w.inputs[1:])]
                w.grad_out = torch.randn_like(x1)
            else:  # 256 rows
                w.inputs = [
                    t.detach()[:256].clone().requires_grad_(t.requires_grad) if t.dim() == 2 else t
                    for t in w.inputs
                ]
                go = w.grad_out
                w.grad_out = tuple(t[:256] for t in go) if isinstance(go, tuple) else go[:256]
            for impl in ("hydra", "compile", "liger", "eager"):
                fn = w.impls.get(impl)
                if fn is None:
                    continue
                try:
                    inputs = [harness.private_copy(t) for t in w.inputs]  # peers may overwrite inputs
                    us = host_us(harness.fwd_bwd_step(fn, inputs, harness.private_copy(w.grad_out)))
                    record("host", what=f"{op} {impl} fwd+bwd (small)", us=us)
                except Exception as exc:
                    record("host", what=f"{op} {impl}", error=f"{type(exc).__name__}: {exc}"[:160])
            break  # one (the first) shape per op


# --- ops --------------------------------------------------------------------------------------


OPS = ["rms_norm", "fused_add_rms_norm", "swiglu", "qk_norm", "rope"]


def section_ops(rep: int) -> None:
    report = bench.run_bench(OPS, rep=rep, progress=lambda m: out.print(f"[dim]{m}[/]"))
    RESULT["bench"] = report
    for s in report["summary"]:
        record("ops", **{k: v for k, v in s.items() if k != "bytes_floor"})


def section_opshost() -> None:
    """Host time of each hydra fwd+bwd at the benchmark shapes (the ``hydra-kernels bench`` rows)."""
    dev = torch.device("cuda")
    liger, info = harness.liger_peers()
    why = None if liger else info  # a version string is no reason
    for op in OPS:
        for w in bench._workloads(op, dev, torch.bfloat16, liger, why):
            step = harness.fwd_bwd_step(w.impls["hydra"], w.inputs, w.grad_out)
            record("opshost", op=op, shape=w.shape, hydra_host_us=host_us(step, 20))
            del w
        torch.cuda.empty_cache()


# --- sweep ------------------------------------------------------------------------------------


def _with(key: str, fields: dict[str, int], pps: tuple[dict[str, int], int] | None, fn) -> float | None:
    launch_config.set_launch_overrides(key, **fields)
    saved = dict(pps[0]) if pps else None
    if pps:
        pps[0].update(dict.fromkeys(pps[0], pps[1]))
    try:
        return harness.graph_ms(fn, rep=40)
    except Exception as exc:
        out.print(f"[yellow]{key} {fields}: {type(exc).__name__}: {str(exc)[:100]}[/]")
        return None
    finally:
        launch_config.clear_launch_overrides()
        if pps:
            pps[0].clear()
            pps[0].update(saved)


def section_sweep(budget_s: float) -> None:
    t_end = time.time() + budget_s
    dev, dt = torch.device("cuda"), torch.bfloat16
    n = 16384

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt)

    cases: list[tuple[str, str, Callable[[], Any], list[tuple[dict[str, int], int | None]], Any]] = []
    for d, fwd_c, bwd_c in (
        (
            768,
            [(4, 4), (8, 4), (8, 8), (2, 2), (16, 8)],
            [(4, 4, 3, 2), (4, 4, 2, 4), (8, 8, 3, 2), (2, 4, 3, 4), (4, 4, 1, 8), (8, 4, 2, 2)],
        ),
        (
            2048,
            [(2, 8), (1, 4), (2, 4), (4, 8), (1, 8)],
            [(2, 8, 3, 2), (1, 4, 3, 4), (2, 8, 2, 2), (1, 8, 3, 2), (1, 4, 2, 8), (2, 4, 3, 3)],
        ),
        (
            4096,
            [(1, 8), (1, 4), (2, 8), (1, 16)],
            [(1, 8, 3, 2), (1, 8, 2, 2), (1, 16, 3, 2), (1, 8, 3, 3), (1, 4, 2, 4), (1, 8, 1, 4)],
        ),
    ):
        x, w, dy, r, ds = rnd(n, d), rnd(d), rnd(n, d), rnd(n, d), rnd(n, d)
        s = x + r
        cases.append(
            (
                "rms_norm",
                f"fwd {n}x{d}",
                lambda x=x, w=w: rms_mod.rms_norm_fwd_launch(x, None, w, 1e-6),
                [({"block_rows": br, "num_warps": nw}, None) for br, nw in fwd_c],
                rms_mod,
            )
        )
        cases.append(
            (
                "rms_norm_bwd",
                f"bwd {n}x{d}",
                lambda x=x, w=w, dy=dy: rms_mod.rms_norm_bwd_launch(dy, x, w, 1e-6, None),
                [({"block_rows": br, "num_warps": nw, "num_stages": st}, p) for br, nw, st, p in bwd_c],
                rms_mod,
            )
        )
        cases.append(
            (
                "rms_norm_bwd",
                f"fused bwd {n}x{d}",
                lambda s=s, w=w, dy=dy, ds=ds: rms_mod.rms_norm_bwd_launch(dy, s, w, 1e-6, ds, True),
                [({"block_rows": br, "num_warps": nw, "num_stages": st}, p) for br, nw, st, p in bwd_c],
                rms_mod,
            )
        )
    for shape in bench.PRESET_HEAD_SHAPES:
        x, dy = rnd(*shape), rnd(*shape)
        t = torch.randn(shape[-2], device=dev)
        rows = (
            [(32, 4), (16, 4), (64, 8), (32, 8), (8, 2)]
            if shape[-1] == 64
            else [(16, 4), (8, 4), (32, 8), (16, 8), (4, 2)]
        )
        cases.append(
            (
                "qk_norm",
                f"fwd {shape}",
                lambda x=x, t=t: qk_mod.qk_norm_fwd_launch(x, 8.0, t),
                [({"block_rows": br, "num_warps": nw}, None) for br, nw in rows],
                None,
            )
        )
        cases.append(
            (
                "qk_norm_bwd",
                f"bwd {shape}",
                lambda x=x, t=t, dy=dy: qk_mod.qk_norm_bwd_launch(dy, x, 8.0, t),
                [
                    ({"block_rows": br, "num_warps": nw, "num_stages": st}, p)
                    for (br, nw), st, p in zip(rows, (3, 3, 2, 2, 3), (4, 4, 2, 2, 8), strict=True)
                ],
                qk_mod,
            )
        )
        for rot in (shape[-1] // 2, shape[-1]):
            ang = torch.rand(shape[1], rot // 2, device=dev) * shape[1]
            c, si = ang.cos(), ang.sin()
            cases.append(
                (
                    "rope",
                    f"{shape} R={rot}",
                    lambda x=x, c=c, si=si: rope_mod._launch_rope(x, c, si, False),
                    [
                        ({"block_rows": br, "num_warps": nw}, None)
                        for br in (8, 16, 32, 64)
                        for nw in (2, 4, 8)
                    ],
                    None,
                )
            )
    for h in (2048, 5440, 10880):
        g, u, dy = rnd(n, h), rnd(n, h), rnd(n, h)
        cfgs = [
            ({"block_q": b, "num_warps": nw}, None)
            for b in (1024, 2048, 4096, 8192)
            for nw in (4, 8, 16)
            if nw * 128 <= b
        ]
        cases.append(("swiglu", f"fwd {n}x{h}", lambda g=g, u=u: sw_mod._launch_swiglu_fwd(g, u), cfgs, None))
        cases.append(
            (
                "swiglu",
                f"bwd {n}x{h}",
                lambda g=g, u=u, dy=dy: sw_mod._launch_swiglu_bwd(g, u, dy),
                cfgs,
                None,
            )
        )
    for key, label, fn, configs, mod in cases:
        if time.time() > t_end:
            record("sweep", skipped=f"{key} {label}: sweep time budget spent")
            continue
        record("sweep", key=key, case=label, config="default", ms=harness.graph_ms(fn, rep=40))
        table = None
        if mod is not None:
            table = mod.BWD_PROGRAMS_PER_SM
        for fields, per_sm in configs:
            if time.time() > t_end:
                break
            t = _with(key, fields, (table, per_sm) if (table is not None and per_sm) else None, fn)
            record(
                "sweep",
                key=key,
                case=label,
                config={**fields, **({"per_sm": per_sm} if per_sm else {})},
                ms=t,
            )
        torch.cuda.empty_cache()


# --- linear + CE ------------------------------------------------------------------------------

#: linear+CE schemes tune.py times (``hydra-kernels bench`` times the default, slab and lean modes
#: beside the peers): fp32-accumulator chunk sizes, and the slab scheme with twice Liger's buffer.
LCE_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32 auto": {},
    "fp32 c1024": {"chunk_rows": 1024},
    "fp32 c2048": {"chunk_rows": 2048},
    "fp32 c4096": {"chunk_rows": 4096},
    "slab auto": {"dw_accum": "slab"},
    "slab 2x": {"dw_accum": "slab", "chunk_rows": -2},  # twice the automatic chunk
    "lean auto": {"dw_accum": "input"},
}


def _lce_opts(name: str, n: int, d: int, v: int) -> dict[str, Any]:
    opts = dict(LCE_VARIANTS[name])
    if opts.get("chunk_rows", 0) < 0:
        from hydra_kernels.ops import _linear_ce_chunks as chunks

        base = chunks.chunk_rows_for(n, d, v, torch.bfloat16, chunks.LinearCEOptions(dw_accum="slab"))
        opts["chunk_rows"] = base * -opts["chunk_rows"]
    return opts


def section_lce(rep: int, variants: list[str], peers: bool) -> None:
    from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol

    dev = torch.device("cuda")
    # correctness on CUDA at an odd shape, every scheme, bf16 mean with z-loss
    n, d, v = 1537, 320, 5003
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    h = torch.randn(n, d, generator=gen, device=dev, dtype=torch.float64)
    w = 0.05 * torch.randn(v, d, generator=gen, device=dev, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=gen, device=dev)
    y[torch.rand(n, generator=gen, device=dev) < 0.2] = -100

    def run(fn, dtype):
        hh = h.detach().to(dtype).requires_grad_()
        ww = w.detach().to(dtype).requires_grad_()
        loss = fn(hh, ww, y, -100, "mean", 1e-3)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    same = run(lce.linear_cross_entropy_ref, torch.bfloat16)
    ref = run(lce.linear_cross_entropy_ref, torch.float64)
    flips = lce.grad_rounding_atol(h, w, y, torch.bfloat16, -100, "mean", 1e-3, 1.0)
    # One chunk of all N tokens: the dh GEMM has torch's own shape. Chunks of 512: cuBLAS may
    # choose another reduction order for the shorter GEMMs than for torch's (a different
    # rounding of dh at isolated elements; the criterion is elementwise).
    cases = (("fp32 auto", n), ("fp32 auto", 512), ("slab auto", n), ("slab auto", 512), ("lean auto", 512))
    for name, rows in cases:
        mode = {k: val for k, val in LCE_VARIANTS[name].items() if k != "chunk_rows"}
        lce.set_linear_ce_options(chunk_rows=rows, **mode)
        try:
            got = run(lce.linear_cross_entropy, torch.bfloat16)
            verdicts = []
            for label, k, t, r, extra in zip(
                ("loss", "dh", "dW"), got, same, ref, (0.0, *flips), strict=True
            ):
                atol = fp32_noise_atol(r) + extra
                if isinstance(atol, torch.Tensor):
                    res = check_against_fp64(k.double() / atol, t.double() / atol, r / atol, 1.0)
                else:
                    res = check_against_fp64(k, t, r, atol)
                verdicts.append(f"{label} {'ok' if res.passed else 'FAIL'} {res.worst_ratio:.3g}")
            record("lce", check=f"{name} chunk {rows}", result=", ".join(verdicts))
        except Exception as exc:
            record("lce", check=f"{name} chunk {rows}", error=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            lce.reset_linear_ce_options()
    torch.cuda.empty_cache()
    liger, _ = harness.liger_peers()
    for n, d, v in ((16384, 768, 50304), (16384, 2048, 128256)):
        hid = torch.randn(n, d, device=dev, dtype=torch.bfloat16).requires_grad_()
        wt = (torch.randn(v, d, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
        tgt = torch.randint(0, v, (n,), device=dev)
        impls: dict[str, Callable[..., Any]] = {f"hydra {k}": lce.linear_cross_entropy for k in LCE_VARIANTS}
        impls["compile"] = torch.compile(
            lambda a, b, c: torch.nn.functional.cross_entropy((a @ b.t()).float(), c)
        )
        if "linear_ce" in liger:
            impls["liger"] = lambda a, b, c: liger["linear_ce"](a, b, c)[0]
        for name, fn in impls.items():
            if name.startswith("hydra"):
                lce.set_linear_ce_options(**_lce_opts(name.removeprefix("hydra "), n, d, v))
            try:
                step = harness.fwd_bwd_step(fn, [hid, wt, tgt], None)
                mib = harness.peak_extra_mib(step)
                t = ms(step, rep)
                record(
                    "lce",
                    shape=f"{n}x{d} V={v}",
                    impl=name,
                    ms=t,
                    MiB=mib,
                    tflops=6 * n * d * v / (t * 1e-3) / 1e12,
                )
            except Exception as exc:
                record("lce", shape=f"{n}x{d} V={v}", impl=name, error=f"{type(exc).__name__}: {exc}"[:200])
                traceback.print_exc(limit=2)
            finally:
                lce.reset_linear_ce_options()
            torch.cuda.empty_cache()
        del hid, wt, tgt
        torch.cuda.empty_cache()


def main(
    section: Annotated[
        list[str] | None, typer.Option("--section", help=f"Any of {SECTIONS}; default all.")
    ] = None,
    rep: Annotated[int, typer.Option("--rep", help="do_bench repetition time, ms.")] = 60,
    deadline: Annotated[
        float, typer.Option("--deadline", help="Seconds from the start by which the sweep (last) stops.")
    ] = 270.0,
    lce_variant: Annotated[
        list[str] | None,
        typer.Option(
            "--lce-variant", help=f"linear+CE schemes to time; default all of {list(LCE_VARIANTS)}."
        ),
    ] = None,
    lce_peers: Annotated[
        bool, typer.Option("--lce-peers/--no-lce-peers", help="Also time torch.compile and Liger.")
    ] = True,
) -> None:
    """Host overhead, op timings, launch-config sweeps and linear+CE schemes on this GPU."""
    require_cuda("tune.py")
    start = time.time()
    chosen = list(section or SECTIONS)
    RESULT.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        sections=chosen,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    hydra_kernels.reset_fallback_counts()
    torch.manual_seed(0)
    runners = {
        "host": section_host,
        "ops": lambda: section_ops(rep),
        "opshost": section_opshost,
        "lce": lambda: section_lce(rep, list(lce_variant or LCE_VARIANTS), lce_peers),
        "sweep": lambda: section_sweep(deadline - (time.time() - start)),
    }
    for name in chosen:
        t0 = time.time()
        try:
            runners[name]()
        except Exception as exc:
            record(name, error=f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
        record(name, seconds=time.time() - t0)
    record("end", fallbacks=hydra_kernels.fallback_counts())


if __name__ == "__main__":
    typer.run(main)
