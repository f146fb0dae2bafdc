"""Training-step throughput of the HYDRA model on one CUDA GPU.

    python packages/hydra-model/bench/bench_model.py    # 100M: dynamic, static, dense × eager, compile
    python packages/hydra-model/bench/bench_model.py --steps 30 --configs dynamic --modes compile

Per (config, mode): bf16 autocast, fp32 weights, fused AdamW, B=8 × T=2048 random tokens over a
32000 vocabulary. tokens/s is the median over timed steps (CUDA events, after warm-up), peak
memory is torch.cuda.max_memory_allocated over the timed steps, FLOPs per token are the model's
own executed count (:meth:`CCGQAMoDMoRModel.flops_per_token`: skipped tokens and recursions not
counted), MFU = tokens/s × FLOPs/token / 989 TFLOP/s (H100 SXM dense bf16). Nothing in the timed
loop reads a value back to the host. Prints a table; writes JSON to $OUT/bench_model.json when
$OUT is set. A wall-clock budget (--time-budget) skips configs that would start too late.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

H100_BF16_PEAK = 989e12
#: the original HYDRA code at the 100M preset, same batch (PERF.md): tokens/s and peak GiB
ORIGINAL_ANCHOR = (90_000, 23.4)

CONFIGS = {
    "dynamic": {},
    "static": {"static_routing_mode": True},
    "dense": {"dense_baseline": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="100M")
    p.add_argument("--configs", default="dynamic,static,dense", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    p.add_argument(
        "--compile-scope",
        choices=("blocks", "model"),
        default="blocks",
        help="blocks: compile the shared CCGQABlock (dynamic shapes, one graph for all "
        "routed lengths, fast to build); model: the whole forward",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compile happens here)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--chunked-ce", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="gradient checkpointing every N blocks (0 = off)"
    )
    p.add_argument("--time-budget", type=float, default=200.0, help="seconds after which no new run starts")
    p.add_argument("--set", action="append", default=[], help="extra config override FIELD=JSON")
    p.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script (no MFU meaning)")
    return p.parse_args(argv)


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, raw = item.split("=", 1)
        out[key] = json.loads(raw)
    return out


def _compile(model, scope: str):
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if scope == "model":
        return torch.compile(model)
    for wrapper in model.blocks:
        wrapper.mor.block.compile(dynamic=True)  # routed lengths vary: one symbolic-shape graph
    return model


def _count_host_syncs(fwd, data: torch.Tensor) -> int:
    """Synchronising calls during one training forward+backward (CUDA sync debug mode)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(data[:, :-1], targets=data[:, 1:])
            out.loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for p in fwd.parameters():
        p.grad = None
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def run_one(args, name: str, mode: str, extra: dict) -> dict:
    import hydra_kernels
    from hydra_model import (
        attention_autotune_report,
        attention_fallback_counts,
        create_ccgqa_mod_mor_model,
        moe_dispatch_counts,
    )

    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    overrides = {**CONFIGS[name], **extra, "vocab_size": args.vocab_size, "use_chunked_ce": args.chunked_ce}
    overrides["max_seq_len"] = max(args.seq_len, 2048)
    model = create_ccgqa_mod_mor_model(args.model_size, **overrides).to(dev).train()
    if args.checkpoint_every:
        model.enable_gradient_checkpointing(every=args.checkpoint_every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    b, t = args.batch_size, args.seq_len
    batches = [torch.randint(0, args.vocab_size, (b, t + 1), device=dev) for _ in range(4)]

    def step(fwd, i: int) -> torch.Tensor:
        data = batches[i % len(batches)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = fwd(data[:, :-1], targets=data[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step(model, 0)  # eager first: measures attention backends per shape, builds lazy state
    sync()
    fwd = model
    t_compile = 0.0
    if mode == "compile":
        t0 = time.perf_counter()
        fwd = _compile(model, args.compile_scope)
        step(fwd, 1)
        sync()
        t_compile = time.perf_counter() - t0
    for i in range(args.warmup):
        step(fwd, i)
    sync()
    host_syncs = _count_host_syncs(fwd, batches[0]) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    marks = []  # CUDA events (no host sync inside the loop) or, on the CPU smoke test, clock reads
    losses = []
    for i in range(args.steps):
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
        losses.append(step(fwd, i))
    marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
    if cuda:
        marks[-1].record()
    sync()
    ms = statistics.median(
        first.elapsed_time(last) if cuda else (last - first) * 1000
        for first, last in itertools.pairwise(marks)
    )
    tok_s = b * t / (ms / 1000)
    flops = model.flops_per_token(t, executed=True)
    result = {
        "config": name,
        "mode": mode if mode == "eager" else f"compile:{args.compile_scope}",
        "params": model.num_parameters(),
        "step_ms": ms,
        "tokens_per_s": tok_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "flops_per_token_executed": flops,
        "flops_per_token_dense": model.flops_per_token(t, executed=False),
        "mfu": tok_s * flops / H100_BF16_PEAK,
        "compile_s": t_compile,
        "host_syncs_fwd_bwd": host_syncs,
        "final_loss": float(torch.stack(losses)[-1]),
        "attention_fallbacks": attention_fallback_counts(),
        "moe_dispatch": moe_dispatch_counts(),
        "kernel_fallbacks": hydra_kernels.fallback_counts(),
        "attention_autotune": attention_autotune_report(),
    }
    return result  # the caller frees the model and optimizer (gc + empty_cache) before the next run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    import triton

    import hydra_model

    extra = _overrides(args.set)
    env = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hydra_model": hydra_model.__version__,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "chunked_ce": args.chunked_ce,
        "checkpoint_every": args.checkpoint_every,
        "overrides": extra,
    }
    print(json.dumps(env))
    start = time.perf_counter()
    results, errors = [], []
    for mode in args.modes.split(","):
        for name in args.configs.split(","):
            elapsed = time.perf_counter() - start
            if elapsed > args.time_budget:
                errors.append(
                    {"config": name, "mode": mode, "error": f"skipped: {elapsed:.0f}s > time budget"}
                )
                continue
            print(f"[{elapsed:6.1f}s] {args.model_size} {name} {mode} …", flush=True)
            try:
                res = run_one(args, name, mode, extra)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                results.append(res)
                print(
                    f"    {res['tokens_per_s'] / 1e3:.1f}K tok/s, {res['peak_gib']:.1f} GiB, "
                    f"MFU {res['mfu'] * 100:.1f}%, compile {res['compile_s']:.0f}s",
                    flush=True,
                )
            except Exception as exc:  # report and go on with the next configuration
                traceback.print_exc()
                errors.append({"config": name, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]})
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()

    print(
        f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {args.model_size}, "
        f"B={args.batch_size} T={args.seq_len}, bf16 autocast, fused AdamW, chunked CE {args.chunked_ce}"
    )
    head = (
        f"{'config':<9}{'mode':<16}{'params':>8}{'tok/s':>10}{'peak GiB':>10}{'GFLOP/tok':>11}{'MFU':>7}"
        f"{'vs 90K':>8}{'syncs':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['config']:<9}{r['mode']:<16}{r['params'] / 1e6:>7.1f}M{r['tokens_per_s'] / 1e3:>9.1f}K"
            f"{r['peak_gib']:>10.1f}{r['flops_per_token_executed'] / 1e9:>11.2f}{r['mfu'] * 100:>6.1f}%"
            f"{r['tokens_per_s'] / ORIGINAL_ANCHOR[0]:>7.2f}×{r['host_syncs_fwd_bwd']!s:>7}"
        )
    print(
        f"anchor: original HYDRA code, 100M preset: {ORIGINAL_ANCHOR[0] / 1e3:.0f}K tok/s, "
        f"{ORIGINAL_ANCHOR[1]} GiB (PERF.md). Targets: ≥4× tok/s, ≤½ memory, ≥40% MFU."
    )
    for e in errors:
        print(f"FAILED {e['config']} {e['mode']}: {e['error']}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_model.json"), "w") as f:
            json.dump({"env": env, "results": results, "errors": errors}, f, indent=2, default=str)
    return 0 if results and not any(math.isnan(r["tokens_per_s"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
