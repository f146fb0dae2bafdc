"""Where a HYDRA training step spends its time: torch.profiler over eager steps, kernels grouped
by kind, GPU busy time against wall time, and micro-benchmarks of the pieces that were suspects.

    python packages/hydra-diag/bench/profile_model.py                       # 100M dynamic, static, dense
    python packages/hydra-diag/bench/profile_model.py --configs dynamic --model-size 250M

Per config: two profiled eager steps after warm-up. Printed: wall ms/step, CPU ms/step spent in
the host's own ops, GPU busy ms/step (sum of kernel durations: with one stream, the gap to wall
time is the GPU waiting on the host), kernel count per step, the kernel kinds by GPU time, the top
kernels. Micro-benchmarks (CUDA-graph timed, so they measure the GPU, not the launch): the CCGQA
conv stage as two cuDNN conv1d calls vs the folded matmul; row gather backward as index_add vs
index_copy. Full tables go to $OUT/profile_<config>.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import CONFIGS, build, make_step

#: (kind, regex on the kernel name), first match wins
KINDS = [
    ("attention", r"flash|fmha|sdpa|attention|cudnn.*(fprop|bprop)|fort_native"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|gemv|ampere_|sm90_|sm80_|splitk|dot_kernel"),
    ("hydra triton", r"^_(rms_norm|swiglu|qk_norm|rope|dw_|ce_rows|scale)_?\w*kernel"),
    ("inductor triton", r"^triton_"),
    ("conv", r"conv|depthwise|implicit"),
    ("optimizer", r"adam|multi_tensor|foreach|^_sq_sums_kernel"),  # with the clip's total norm
    ("sort/topk", r"sort|topk|radix|bitonic|TopK"),
    ("index/scatter", r"index|scatter|gather|embedding"),
    ("reduce", r"reduce|Reduce|norm_kernel|mean|sum_"),
    ("copy/cast/fill", r"copy|Memcpy|memset|Memset|fill|cat_|CatArray|pad"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kernel_events(prof) -> list[tuple[str, float]]:
    """(name, µs) of every device activity (kernels, copies, fills) the profiler recorded. User
    annotations are left out: a ``record_function`` range (``Optimizer.step#AdamW.step``) also
    shows on the device's timeline, spanning kernels already counted."""
    cuda = torch.autograd.DeviceType.CUDA
    out = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    ]
    if not out:  # older layouts keep device activities only in the raw kineto results
        for k in prof.profiler.kineto_results.events():
            if k.device_type() == cuda and not k.is_user_annotation():
                out.append((k.name(), k.duration_ns() / 1e3))
    return out


def profile_config(args, name: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    model, opt, batches = build(args, name, {}, capturable=False)
    step = make_step(model, opt, "cuda")
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for i in range(args.steps):
            step(batches[i % len(batches)])
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / args.steps
    kernels = kernel_events(prof)
    busy_us = sum(us for _, us in kernels) / args.steps
    by_kind: dict[str, float] = defaultdict(float)
    count_kind: Counter[str] = Counter()
    by_name: dict[str, float] = defaultdict(float)
    count_name: Counter[str] = Counter()
    for kname, us in kernels:
        k = kind_of(kname)
        by_kind[k] += us / args.steps
        count_kind[k] += 1
        by_name[kname] += us / args.steps
        count_name[kname] += 1
    lines = [
        f"== {args.model_size} {name}: wall {wall:.1f} ms/step, GPU busy {busy_us / 1e3:.1f} ms/step "
        f"({100 * busy_us / 1e3 / wall:.0f}%), {len(kernels) / args.steps:.0f} kernels/step",
        f"{'kind':<18}{'ms/step':>9}{'share':>7}{'kernels':>9}",
    ]
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"{k:<18}{us / 1e3:>9.2f}{100 * us / busy_us:>6.0f}%{count_kind[k] / args.steps:>9.0f}")
    lines.append("top kernels (ms/step, calls/step):")
    for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"  {us / 1e3:8.2f} {count_name[n] / args.steps:6.0f}  {kind_of(n):<16} {n[:110]}")
    summary = "\n".join(lines)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"profile_{args.model_size}_{name}.txt"), "w") as f:
            f.write(summary + "\n\nCPU-side ops by self CPU time:\n" + table)
    return summary


def _graph_ms(fn, reps: int = 20) -> float:
    """GPU ms of fn() replayed from a CUDA graph (launch cost excluded)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=reps * 5, return_mode="median"))


def micro_benchmarks() -> list[str]:
    import torch.nn.functional as F

    from hydra_model.ccgqa import qk_mean_matrix
    from hydra_model.ccgqa_fold import folded_qk_weight

    out = []
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, n, hq, hkv, d = 8, 2048, 4, 2, 64
    c = (hq + hkv) * d
    u = torch.randn(b, n, c, device=dev, dtype=dt, requires_grad=True)
    w1 = torch.randn(c, 1, 2, device=dev, requires_grad=True)
    b1 = torch.randn(c, device=dev, requires_grad=True)
    w2 = torch.randn(c, d, 2, device=dev, requires_grad=True)
    b2 = torch.randn(c, device=dev, requires_grad=True)
    mix = qk_mean_matrix(hq, hkv, d).to(dev)
    grad = torch.randn(b, n, c, device=dev, dtype=dt)

    def conv1d_path():
        with torch.autocast("cuda", dtype=dt):
            win = F.pad(u.transpose(1, 2), (2, 0))
            z = F.conv1d(win, w1, b1, groups=c)
            z = F.conv1d(z, w2, b2, groups=hq + hkv).transpose(1, 2)
            qp, kp = (
                u[..., : hq * d].reshape(b, n, hkv, hq // hkv, d),
                u[..., hq * d :].reshape(b, n, hkv, 1, d),
            )
            mean = 0.5 * (qp + kp)
            q = z[..., : hq * d].reshape(b, n, hq, d) + mean.reshape(b, n, hq, d)
            k = z[..., hq * d :].reshape(b, n, hkv, d) + mean.mean(3)
            y = torch.cat([q.reshape(b, n, -1), k.reshape(b, n, -1)], -1)
        torch.autograd.backward(y, grad)

    def folded_path():
        with torch.autocast("cuda", dtype=dt):
            win = F.pad(u, (0, 0, 2, 0))
            taps = win.unfold(1, 3, 1).reshape(b, n, 3 * c)
            weight, bias = folded_qk_weight(w1, b1, w2, b2, mix)
            y = F.linear(taps, weight, bias)
        torch.autograd.backward(y, grad)

    for label, fn in (
        ("conv stage, 2×cuDNN conv1d + q-k mean", conv1d_path),
        ("conv stage, folded GEMM", folded_path),
    ):
        try:
            out.append(f"{label:<42} fwd+bwd {_graph_ms(fn):.3f} ms  (B=8 n=2048 C={c} bf16)")
        except Exception as exc:
            out.append(f"{label:<42} failed: {type(exc).__name__}: {str(exc)[:200]}")

    rows, e, m = 8 * 2048, 768, 6 * 1024
    idx = torch.randperm(rows, device=dev)[:m]
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(m, e, device=dev, dtype=dtype)
        z = torch.zeros(rows, e, device=dev, dtype=dtype)
        add = _graph_ms(lambda z=z, g=g: z.zero_().index_add_(0, idx, g))
        cpy = _graph_ms(lambda z=z, g=g: z.zero_().index_copy_(0, idx, g))
        out.append(
            f"gather backward {str(dtype)[6:]:<9} [{rows}x{e}] ← {m} rows: index_add {add:.3f} ms, "
            f"index_copy {cpy:.3f} ms"
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="100M")
    p.add_argument("--configs", default="dynamic,static,dense")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--no-micro", action="store_true")
    args = p.parse_args(argv)
    args.device, args.chunked_ce, args.checkpoint_every = "cuda", True, 0
    if not torch.cuda.is_available():
        print("profile_model.py needs a CUDA GPU", file=sys.stderr)
        return 1
    for name in args.configs.split(","):
        if name not in CONFIGS:
            print(f"unknown config {name!r}; expected {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
        print(profile_config(args, name), flush=True)
        torch.cuda.empty_cache()
    if not args.no_micro:
        print("\n".join(micro_benchmarks()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
