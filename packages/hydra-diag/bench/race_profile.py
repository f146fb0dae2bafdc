"""Where the race's training step spends its time, per configuration, the way the race runs it.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/race_profile.py --configs gpt,gpt-ccgqa,hydra --out prof.json
    python packages/hydra-diag/bench/race_profile.py --configs hydra --set 'hydra.compile="graphs"' \
        --out p.json

Each configuration is built, warmed up and compiled exactly as ``hydra-diag race run`` does
(hydra_diag/race/loop.py: eager passes first, then the compile scope), on random tokens (routing
shapes are fixed, so speed does not depend on the text). Then: setup seconds, graphs compiled,
steady tokens/s over ``--steps`` steps (CUDA-synchronised wall clock), the steady step's memory
(below), and one torch.profiler pass over ``--profile_steps`` steps: GPU busy time per step
against wall time (the gap is the GPU waiting on the host), kernel launches per step, GPU time by
kernel kind and the top kernels. Everything goes to the JSON at ``--out`` and a summary to stdout.

Memory (:func:`steady_steps`): ``peak_gib``, ``graph_pool_gib`` and ``peak_allocated_gib`` of
hydra_diag/device_memory.py over the steady steps, rounded to 0.01 GiB. ``peak_gib`` is the most
the caching allocator held, the CUDA graphs' private pool included. ``peak_allocated_gib`` is the
figure this script used to call ``peak_gib`` (BENCHMARKS.md's "peak GiB" of 2026-11-27): a replay
allocates nothing, so under the graphs scope it counts only the memory allocated outside the
graphs (parameters and AdamW's two moments, 12 bytes a parameter, and the eager parts'
temporaries), not the step's activations or gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict

import torch

from hydra_diag.device_memory import peak_memory, reset_peak_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling profile_model.py
from profile_model import kernel_events, kind_of


def steady_steps(step, steps: int, device: torch.device) -> tuple[float, object, dict]:
    """``steps`` timed calls of ``step`` after the warm-up: (seconds a step, the last step's output,
    memory in GiB: the module's docstring)."""
    reset_peak_memory(device)
    step()  # untimed: what the reset released from the cache is allocated again outside the timing
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
        out = step()
    torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / steps
    memory = {k: None if v is None else round(v, 2) for k, v in peak_memory(device).items()}
    return dt, out, memory


def profile_config(cfg, args, device) -> dict:
    from hydra_diag.race.loop import BETAS, build_entrant, compile_entrant, graphs_compiled
    from hydra_train.optim import build_optimizer, clip_and_step

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = build_entrant(cfg, args.model_size, args.vocab, args.seq_len, device).to(device).train()
    gen = torch.Generator(device=device).manual_seed(1)

    def batch():
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), device=device, generator=gen)
        return x[:, :-1], x[:, 1:]

    x, y = batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, targets=y).loss.backward()
    model.zero_grad(set_to_none=True)
    g_before = graphs_compiled()
    fwd = compile_entrant(model, cfg.compile) if cfg.compile != "none" else model
    opt = build_optimizer(model, lr=cfg.lr, weight_decay=0.1, betas=BETAS, log=lambda m: None).optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    commit = getattr(model, "commit_router_thresholds", None)
    if commit is not None:
        model.threshold_commit = "manual"
    graphs_mode = cfg.compile == "graphs"

    def step():
        x, y = batch()
        if graphs_mode:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(x, targets=y, return_logits=args.return_logits)
        out.loss.backward()
        clip_and_step(opt, params, 1.0)
        if commit is not None:
            commit()
        opt.zero_grad(set_to_none=True)
        return out.ce_loss.detach().clone()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    graphs = graphs_compiled() - g_before
    dt, loss, memory = steady_steps(step, args.steps, device)
    graphs_after = graphs_compiled() - g_before - graphs
    tok_s = args.batch_size * args.seq_len / dt
    fpt = float(model.flops_per_token(args.seq_len, executed=True))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tp = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        torch.cuda.synchronize()
        wall_prof = (time.perf_counter() - tp) / args.profile_steps
    events = kernel_events(prof)
    n = args.profile_steps
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    for name, us in events:
        by_kind[kind_of(name)] += us / n / 1e3
        by_name[name[:90]] += us / n / 1e3
        counts[name[:90]] += 1
    busy = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]
    return {
        "name": cfg.name,
        "compile": cfg.compile,
        "overrides": cfg.overrides,
        "setup_s": round(setup_s, 1),
        "graphs_compiled_setup": graphs,
        "graphs_compiled_after_warmup": graphs_after,
        "ms_per_step": round(dt * 1e3, 2),
        "tokens_per_s": round(tok_s),
        "gflop_per_token_executed": round(fpt / 1e9, 4),
        "mfu_989": round(fpt * tok_s / 989e12, 4) if fpt else None,  # fpt counts fwd + bwd
        **memory,
        "last_loss": float(loss),
        "profiled_wall_ms_per_step": round(wall_prof * 1e3, 2),
        "gpu_busy_ms_per_step": round(busy, 2),
        "kernels_per_step": round(len(events) / n),
        "ms_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [(k, round(v, 3), counts[k] // n) for k, v in top],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="gpt,hydra")
    p.add_argument("--set", action="append", default=[], help="race-style CONFIG.FIELD=VALUE")
    p.add_argument("--model_size", default="100M")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile_steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--return_logits",
        action="store_true",
        help="the step takes the logits too (as the race did before 2026-11-27); by default it "
        "asks for the losses alone, as the race does",
    )
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args()
    from hydra_diag.race.configs import parse_config_names, parse_sets, resolve_configs
    from hydra_diag.race.loop import release

    device = torch.device("cuda")
    cfgs = resolve_configs(
        parse_config_names(args.configs), parse_sets(args.set), lr=6e-4, compile_default="graphs"
    )
    results = []
    for cfg in cfgs:
        print(f"== {cfg.name} ({cfg.compile}) {cfg.overrides}", flush=True)
        try:
            r = profile_config(cfg, args, device)
        except Exception as exc:  # one failing variant must not lose the others' figures
            r = {"name": cfg.name, "compile": cfg.compile, "overrides": cfg.overrides}
            r["error"] = repr(exc)[:2000]
        print(json.dumps({k: v for k, v in r.items() if k != "top_kernels_ms"}), flush=True)
        for k, ms, c in r.get("top_kernels_ms", [])[:12]:
            print(f"   {ms:8.3f} ms x{c:<4d} {k}")
        results.append(r)
        release(device)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "args": vars(args),
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
