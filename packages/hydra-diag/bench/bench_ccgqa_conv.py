"""CCGQA's conv stage, head-wise GEMMs against the folded block-diagonal GEMM, on a GPU.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/bench_ccgqa_conv.py --out "$OUT/ccgqa_conv.json"

For two head layouts at B=8 × T=2048, E=768 — the 2026-11-23 preset's compressed one (4 query,
2 kv latent heads of 64: C = 384) and the dense GPT's (12 query, 4 kv heads of 64: C = 1024, the
``gpt-ccgqa`` race entrant and the new 100M preset) — it times a whole CCGQAAttention forward +
backward (bf16 autocast) with each ``conv_impl``, eager and under ``torch.compile``, and for
comparison the plain GQA attention of the same head layout (GQAAttention). Outputs of the two
conv forms are checked against each other first (same weights, fresh random input). Medians of
``triton.testing.do_bench`` (``hydra_kernels.bench_harness.time_ms``); JSON to ``--out``; a table last.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (small shapes)")
    args = ap.parse_args()

    from hydra_kernels.bench_harness import time_ms, write_report
    from hydra_model.ccgqa import CONV_IMPLS, CCGQAAttention
    from hydra_model.gqa import GQAAttention
    from hydra_model.layers import RotaryEmbedding

    dev = torch.device(args.device)
    cast = torch.autocast(dev.type, dtype=torch.bfloat16)
    e, b, n = 768, args.batch, args.seq
    rows = []
    for label, hq, hkv, d in (("compressed C=384", 4, 2, 64), ("gpt layout C=1024", 12, 4, 64)):
        rope = RotaryEmbedding(d // 2, n).to(dev)
        cos, sin = rope.tables(n)
        torch.manual_seed(0)
        mods = {impl: CCGQAAttention(e, hq, hkv, d, d // 2, conv_impl=impl).to(dev) for impl in CONV_IMPLS}
        mods["folded"].load_state_dict(mods["headwise"].state_dict())
        mods["gqa"] = GQAAttention(e, hq, hkv, d, d // 2).to(dev)
        x = torch.randn(b, n, e, device=dev, requires_grad=True)
        grad = torch.randn(b, n, e, device=dev, dtype=torch.bfloat16)
        with torch.no_grad(), cast:
            a, c = (mods[i](x, cos, sin).float() for i in CONV_IMPLS)
        rel = float((a - c).norm() / c.norm())
        for name, mod in mods.items():
            for compiled in (False, True):
                fn_mod = torch.compile(mod) if compiled else mod

                def step(fn_mod=fn_mod, x=x, cos=cos, sin=sin, grad=grad):
                    with cast:
                        out = fn_mod(x, cos, sin)
                    out.backward(grad)

                try:
                    if dev.type == "cuda":
                        ms = time_ms(step, rep=args.rep)
                    else:  # smoke test: one timed call
                        step()
                        ms = 0.0
                    err = None
                except Exception as exc:  # a failure is a row, not a crash
                    ms, err = math.nan, f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(
                    {
                        "layout": label,
                        "impl": name,
                        "compiled": compiled,
                        "fwd_bwd_ms": ms,
                        "error": err,
                        "headwise_vs_folded_rel_diff": rel,
                    }
                )
                x.grad = None
                for p in mod.parameters():
                    p.grad = None
    meta = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"batch": b, "seq": n, "dim": e},
    }
    if args.out:
        write_report({"meta": meta, "rows": rows}, Path(args.out))
    print(f"{meta['device']}, torch {meta['torch']}, B={b} T={n} E={e}, fwd+bwd bf16 ms (median)")
    print(f"{'layout':<20} {'impl':<9} {'eager':>8} {'compiled':>9}  rel diff")
    for label in dict.fromkeys(r["layout"] for r in rows):
        for impl in ("headwise", "folded", "gqa"):
            sel = {r["compiled"]: r for r in rows if r["layout"] == label and r["impl"] == impl}
            print(
                f"{label:<20} {impl:<9} {sel[False]['fwd_bwd_ms']:8.3f} {sel[True]['fwd_bwd_ms']:9.3f}"
                f"  {sel[False]['headwise_vs_folded_rel_diff']:.1e}"
            )


if __name__ == "__main__":
    main()
