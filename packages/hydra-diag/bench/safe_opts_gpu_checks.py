"""GPU checks of the SafeOptimizations pieces a CPU cannot run (one CUDA GPU, about 20 s).

1. FP8: ``scaled_matmul`` on the tensor cores against the emulation of the same quantised operands
   (must agree to bf16 output rounding) and against fp64 on the unquantised operands (error of the
   order of the format's unit roundoff), for E4M3/E5M2, row/tensor scales, odd token counts; plus
   the forward+backward time of an FP8 linear against a bf16 one at 100M-preset widths.
2. bitsandbytes: this repository's blockwise quantiser against bitsandbytes' own
   ``quantize_blockwise``/``dequantize_blockwise`` with the optimizer's code tables, and a
   torch -> AdamW8bit -> torch round trip of real Adam moments.

Prints one line per check (``ok`` / ``FAIL``) and writes ``$OUT/safe_opts_gpu_checks.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hydra_train.safe_opts.adam8bit import dequantize_blockwise, quantize_blockwise, to_8bit, to_torch_adamw
from hydra_train.safe_opts.fp8 import FP8_FORMATS, Fp8Linear, dequantize, quantize, scaled_matmul

results: dict[str, object] = {}
failed = False


def report(name: str, ok: bool, info: str) -> None:
    global failed
    failed |= not ok
    results[name] = {"ok": ok, "info": info}
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {info}", flush=True)


def check_fp8() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for fmt in ("e4m3", "e5m2"):
        u8 = FP8_FORMATS[fmt][2]
        for rowwise in (True, False):
            name = f"fp8 {fmt} {'row' if rowwise else 'tensor'}"
            try:
                x = torch.randn(4101, 768, device="cuda", generator=g).to(torch.bfloat16)
                w = torch.randn(2048, 768, device="cuda", generator=g) * 0.02
                xq, sx = quantize(x, fmt, rowwise)
                wq, sw = quantize(w, "e4m3", rowwise)  # weights are always E4M3 (see fp8.py)
                out = scaled_matmul(xq, sx, wq, sw, torch.bfloat16).float()
                emu = dequantize(xq, sx) @ dequantize(wq, sw).t()
                ref = x.double() @ w.double().t()
                emu_err = ((out - emu).norm() / emu.norm()).item()
                ref_err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = emu_err < 4 * 2**-8 and ref_err < 2 * u8
                report(
                    name,
                    ok,
                    f"vs emulation {emu_err:.2e} (< {4 * 2**-8:.1e}), vs fp64 {ref_err:.2e} (< {2 * u8:.2e})",
                )
            except Exception as exc:
                report(name, False, f"{type(exc).__name__}: {str(exc)[:200]}")
    # speed at the 100M MLP widths: [16384 tokens, 768] x [8192, 768]
    try:
        lin = torch.nn.Linear(768, 8192, bias=False, device="cuda")
        x = torch.randn(16384, 768, device="cuda", requires_grad=True)

        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(x)
            y.float().sum().backward()

        def timed():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                run()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / 20 * 1000

        bf16 = timed()
        lin.__class__ = Fp8Linear
        fp8 = timed()
        lin.__class__ = torch.nn.Linear
        report("fp8 linear speed", True, f"fwd+bwd 16384x768->8192: bf16 {bf16:.3f} ms, fp8 fwd {fp8:.3f} ms")
    except Exception as exc:
        report("fp8 linear speed", False, f"{type(exc).__name__}: {str(exc)[:200]}")


def check_bnb() -> None:
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
    except Exception as exc:
        report("bitsandbytes", False, f"not importable: {exc}")
        return
    try:
        p = torch.nn.Parameter(torch.randn(10_000, device="cuda"))
        opt8 = bnb.optim.AdamW8bit([p], lr=1e-3)
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt8.step()
        s = opt8.state[p]
        for i in (1, 2):
            mine = dequantize_blockwise(s[f"state{i}"], s[f"qmap{i}"], s[f"absmax{i}"])
            theirs = F.dequantize_blockwise(
                s[f"state{i}"], absmax=s[f"absmax{i}"], code=s[f"qmap{i}"], blocksize=256
            )
            err = (mine - theirs.view_as(mine)).abs().max().item()
            report(f"bnb dequantize state{i}", err == 0.0, f"max |mine - bitsandbytes| = {err:.3g}")
            x = torch.randn(10_000, device="cuda") * (1.0 if i == 1 else 0.0) + (
                torch.rand(10_000, device="cuda") if i == 2 else 0
            )
            q, absmax = quantize_blockwise(x, s[f"qmap{i}"])
            q2, st2 = F.quantize_blockwise(x, code=s[f"qmap{i}"], blocksize=256)
            same = (q == q2.view(-1)).float().mean().item()
            amax_err = (absmax - st2.absmax).abs().max().item()
            back = dequantize_blockwise(q, s[f"qmap{i}"], absmax)
            rel = ((back - x).norm() / x.norm()).item()
            info = f"same codes {same:.4f}, absmax diff {amax_err:.2g}, round-trip rel err {rel:.2e}"
            report(f"bnb quantize state{i}", same > 0.99 and amax_err == 0.0, info)
        # round trip of real moments: torch AdamW -> 8-bit -> torch
        q = torch.nn.Parameter(torch.randn(50_000, device="cuda"))
        opt = torch.optim.AdamW([q], lr=1e-3, fused=True)
        for _ in range(3):
            q.grad = torch.randn_like(q)
            opt.step()
        st = {k: v.clone() for k, v in opt.state[q].items()}
        back = to_torch_adamw(to_8bit(opt, bnb), fused=True).state[q]
        errs = [((back[k] - st[k]).norm() / st[k].norm()).item() for k in ("exp_avg", "exp_avg_sq")]
        info = f"rel err exp_avg {errs[0]:.2e}, exp_avg_sq {errs[1]:.2e}, step {float(back['step'])}"
        report(
            "torch->8bit->torch moments", max(errs) < 0.05 and float(back["step"]) == float(st["step"]), info
        )
    except Exception as exc:
        report("bitsandbytes", False, f"{type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        sys.exit(1)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    check_fp8()
    check_bnb()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "safe_opts_gpu_checks.json"), "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(1 if failed else 0)
