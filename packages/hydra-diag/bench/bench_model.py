"""Training-step throughput of the HYDRA model on one CUDA GPU.

    python packages/hydra-diag/bench/bench_model.py          # 100M: dynamic, static, dense × eager, graph
    python packages/hydra-diag/bench/bench_model.py --modes eager,graph,compile,compile+graph
    python packages/hydra-diag/bench/bench_model.py --model-size 500M --configs dynamic --modes graph
    python packages/hydra-diag/bench/bench_model.py --configs gpt,gpt-ccgqa,dynamic --modes eager,graph

Per (config, mode): bf16 autocast, fp32 weights, fused AdamW, B=8 × T=2048 random tokens over a
32000 vocabulary. Modes: ``eager``; ``graph`` (the whole step — forward, backward, AdamW — captured
once as a CUDA graph with :class:`hydra_model.CUDAGraphStep` and replayed); ``compile`` (the shared
CCGQABlock compiled, ``--compile-scope``); ``compile+graph`` (both). tokens/s is the median over
timed steps (CUDA events, after warm-up); peak memory is torch.cuda.max_memory_allocated from the
warm-up (and, for graphs, the capture) through the timed steps — for graphs at least the memory
still reserved after the timed steps and an empty_cache (the graph's private pool, which the
allocator counts as free between replays); FLOPs per token are the model's
own executed count (:meth:`CCGQAMoDMoRModel.flops_per_token`: skipped tokens and recursions not
counted); MFU = tokens/s × FLOPs/token / 989 TFLOP/s (H100 SXM dense bf16). Host syncs are
counted over one eager (or compiled) forward+backward in CUDA sync-debug mode, with the source
line of each. Graph modes check that the replayed step's loss equals an eager forward's loss on
the same weights and batch. Prints a table; writes JSON to $OUT/bench_model_<size>_<modes>.json
when $OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

from hydra_diag.harness import compile_model, train_step

H100_BF16_PEAK = 989e12
#: the original HYDRA code at the 100M preset, same batch (docs/TARGETS.md): tokens/s and peak GiB
ORIGINAL_ANCHOR = (90_000, 23.4)

CONFIGS = {
    "dynamic": {},
    "static": {"static_routing_mode": True},
    "dense": {"routing_off": True},
    # the dense GPT baseline of the same preset size (hydra_model.build_model("gpt", ...))
    "gpt": {"arch": "gpt"},
    "gpt-ccgqa": {"arch": "gpt", "attention": "ccgqa"},
}
MODES = ("eager", "graph", "compile", "compile+graph")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="100M")
    p.add_argument("--configs", default="dynamic,static,dense", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--modes", default="eager,graph", help=f"comma list of {','.join(MODES)}")
    p.add_argument(
        "--compile-scope",
        choices=("blocks", "blocks-static", "model"),
        default="blocks",
        help="blocks: the shared CCGQABlock with dynamic shapes (one graph for every routed length); "
        "blocks-static: the same, one graph per length; model: the whole forward (static shapes)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
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


def sync_sites(fwd, params, data: torch.Tensor) -> list[str]:
    """Source lines of the synchronising calls in one training forward+backward."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(data[:, :-1], targets=data[:, 1:])
            out.loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for p in params:
        p.grad = None
    return [
        f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()
    ]


def locate_first_sync(fwd, params, data: torch.Tensor) -> str:
    """Where the first synchronising call of a forward+backward happens: sync-debug "error"
    mode raises there; anomaly mode adds the forward stack of a backward node that raised."""
    import traceback as tb

    text = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = fwd(data[:, :-1], targets=data[:, 1:])
                out.loss.backward()
        except RuntimeError:
            text = tb.format_exc(limit=-12)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for p in params:
        p.grad = None
    notes = [str(w.message) for w in caught if "forward call" in str(w.message)]
    return (text + "\n".join(notes))[-4000:]


def build(args, name: str, extra: dict, capturable: bool):
    from hydra_model import build_model

    torch.manual_seed(0)
    dev = torch.device(args.device)
    overrides = {**CONFIGS[name], **extra, "vocab_size": args.vocab_size, "use_chunked_ce": args.chunked_ce}
    overrides["max_seq_len"] = max(args.seq_len, 2048)
    arch = overrides.pop("arch", "hydra")
    model = build_model(arch, args.model_size, **overrides).to(dev).train()
    if args.checkpoint_every:
        model.enable_gradient_checkpointing(every=args.checkpoint_every)
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, capturable=capturable and fused)
    gen = torch.Generator(device=dev).manual_seed(1)
    batches = [
        torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=dev, generator=gen)
        for _ in range(4)
    ]
    return model, opt, batches


def make_step(fwd, opt, device_type: str):
    """The step CUDAGraphStep captures: hydra_diag.harness.train_step on a given batch."""
    return functools.partial(train_step, fwd, opt, device_type=device_type)


def graph_matches_eager(model, runner, data: torch.Tensor) -> float:
    """|replayed loss − eager loss| / |eager loss| on the same weights and batch (the replayed
    step's loss is computed before its own optimizer update); the eager reference runs the
    routing glue op by op, so this also checks the compiled routing functions."""
    from hydra_model.fused_routing import compiled_routing_enabled, set_compiled_routing

    was = compiled_routing_enabled()
    set_compiled_routing(False)  # the reference runs every op on its own
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            eager = model(data[:, :-1], targets=data[:, 1:]).loss.float()
    finally:
        set_compiled_routing(was)
    replayed = runner(data).float()
    return float(((replayed - eager).abs() / eager.abs()).item())


def run_one(args, name: str, mode: str, extra: dict) -> dict:
    import hydra_kernels
    from hydra_model import (
        CUDAGraphStep,
        attention_autotune_report,
        attention_fallback_counts,
        moe_dispatch_counts,
    )
    from hydra_model.fused_routing import compiled_routing_counts

    cuda = args.device == "cuda"
    graphed = mode.endswith("graph")
    if graphed and not cuda:
        raise RuntimeError("graph modes need CUDA")
    t_start = time.perf_counter()  # setup: build, first eager step, compile, warm-up, capture
    model, opt, batches = build(args, name, extra, capturable=graphed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    make_step(model, opt, args.device)(batches[0])  # eager first: measures attention backends per shape
    sync()
    fwd = model
    t_compile = 0.0
    if mode.startswith("compile"):
        t0 = time.perf_counter()
        fwd = compile_model(model, args.compile_scope, static_model=True)
        make_step(fwd, opt, args.device)(batches[1])
        sync()
        t_compile = time.perf_counter() - t0
    step = make_step(fwd, opt, args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    sync()
    t_setup = time.perf_counter() - t_start  # the sync-site count below is a measurement, not setup
    sites = sync_sites(fwd, list(model.parameters()), batches[0]) if cuda else []
    first_sync = locate_first_sync(fwd, list(model.parameters()), batches[0]) if sites else ""
    graph_check = None
    t_capture = 0.0
    if graphed:
        t0 = time.perf_counter()
        runner = CUDAGraphStep(step, batches[0], warmup=2)
        sync()
        t_capture = time.perf_counter() - t0
        graph_check = graph_matches_eager(model, runner, batches[1])
        step = runner
    marks, losses = [], []  # CUDA events (no host sync in the loop) or, on the CPU, clock reads
    for i in range(args.steps):
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
        losses.append(step(batches[i % len(batches)]).clone())
    marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
    if cuda:
        marks[-1].record()
    sync()
    times = [
        first.elapsed_time(last) if cuda else (last - first) * 1000
        for first, last in itertools.pairwise(marks)
    ]
    ms = statistics.median(times)
    peak_alloc = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    held = float("nan")
    if cuda:
        # a replayed graph writes into its private pool, which the allocator counts as free
        # between replays: what a graphed step really holds is the pool, i.e. the memory still
        # reserved once every cached block outside it is released
        gc.collect()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved() / 2**30
    b, t = args.batch_size, args.seq_len
    tok_s = b * t / (ms / 1000)
    flops = model.flops_per_token(t, executed=True)
    return {
        "config": name,
        "mode": mode if not mode.startswith("compile") else f"{mode}:{args.compile_scope}",
        "model_size": args.model_size,
        "params": model.num_parameters(),
        "step_ms": ms,
        "step_ms_min_max": [min(times), max(times)],
        "tokens_per_s": tok_s,
        "peak_gib": max(peak_alloc, held) if graphed else peak_alloc,
        "peak_allocated_gib": peak_alloc,
        "held_after_steps_gib": held,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
        "flops_per_token_executed": flops,
        "flops_per_token_dense": model.flops_per_token(t, executed=False),
        "mfu": tok_s * flops / H100_BF16_PEAK,
        "compile_s": t_compile,
        "capture_s": t_capture,
        "setup_s": t_setup + t_capture,
        "host_syncs_fwd_bwd": len(sites) if cuda else None,
        "host_sync_sites": sites,
        "first_sync_traceback": first_sync,
        "graph_vs_eager_rel_loss_diff": graph_check,
        "final_loss": float(torch.stack(losses)[-1]),
        "attention_fallbacks": attention_fallback_counts(),
        "moe_dispatch": moe_dispatch_counts(),
        "kernel_fallbacks": hydra_kernels.fallback_counts(),
        "compiled_routing": compiled_routing_counts(),
        "attention_autotune": attention_autotune_report(),
    }


def print_table(env: dict, args, results: list[dict]) -> None:
    print(
        f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {args.model_size}, "
        f"B={args.batch_size} T={args.seq_len}, bf16 autocast, fused AdamW, chunked CE {args.chunked_ce}"
    )
    head = (
        f"{'config':<10}{'mode':<22}{'params':>8}{'ms':>8}{'tok/s':>10}{'peak GiB':>10}{'GFLOP/tok':>11}"
        f"{'MFU':>7}{'vs 90K':>8}{'syncs':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['config']:<10}{r['mode']:<22}{r['params'] / 1e6:>7.1f}M{r['step_ms']:>8.1f}"
            f"{r['tokens_per_s'] / 1e3:>9.1f}K{r['peak_gib']:>10.1f}"
            f"{r['flops_per_token_executed'] / 1e9:>11.2f}"
            f"{r['mfu'] * 100:>6.1f}%{r['tokens_per_s'] / ORIGINAL_ANCHOR[0]:>7.2f}×"
            f"{r['host_syncs_fwd_bwd']!s:>7}"
        )
    print(
        f"anchor: original HYDRA code, 100M preset: {ORIGINAL_ANCHOR[0] / 1e3:.0f}K tok/s, "
        f"{ORIGINAL_ANCHOR[1]} GiB (docs/TARGETS.md). Targets: ≥4× tok/s, ≤½ memory, ≥40% MFU."
    )
    for r in results:
        if r["host_sync_sites"]:
            print(f"host syncs {r['config']} {r['mode']}: {', '.join(r['host_sync_sites'])}")
            print(r["first_sync_traceback"][-1500:])
        failed = {k: v for k, v in r["compiled_routing"].items() if k.endswith(":failed")}
        if failed:
            print(f"compiled routing FAILED {r['config']} {r['mode']}: {failed} (ran op by op)")
        if r["graph_vs_eager_rel_loss_diff"] is not None:
            print(
                f"graph check {r['config']} {r['mode']}: replayed vs eager loss rel. diff "
                f"{r['graph_vs_eager_rel_loss_diff']:.2e}, capture {r['capture_s']:.1f}s"
            )


def environment(args, extra: dict) -> dict:
    import triton

    import hydra_model

    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hydra_model": hydra_model.__version__,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "chunked_ce": args.chunked_ce,
        "checkpoint_every": args.checkpoint_every,
        "overrides": extra,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HYDRA_")},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        print(f"unknown mode(s) {bad}; expected {MODES}", file=sys.stderr)
        return 2
    extra = _overrides(args.set)
    env = environment(args, extra)
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
                results.append(res)
                print(
                    f"    {res['step_ms']:.1f} ms, {res['tokens_per_s'] / 1e3:.1f}K tok/s, "
                    f"{res['peak_gib']:.1f} GiB, MFU {res['mfu'] * 100:.1f}%, "
                    f"compile {res['compile_s']:.0f}s, setup {res['setup_s']:.1f}s",
                    flush=True,
                )
            except Exception as exc:  # report and go on with the next configuration
                traceback.print_exc()
                errors.append({"config": name, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:800]})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print_table(env, args, results)
    for e in errors:
        print(f"FAILED {e['config']} {e['mode']}: {e['error']}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        tag = "-".join(m.replace("+", "_") for m in args.modes.split(","))
        path = os.path.join(out_dir, f"bench_model_{args.model_size}_{tag}.json")
        with open(path, "w") as f:
            json.dump({"env": env, "results": results, "errors": errors}, f, indent=2, default=str)
    return 0 if results and not any(math.isnan(r["tokens_per_s"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
