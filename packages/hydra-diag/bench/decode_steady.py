"""A decode step's steady-state time on one GPU, without prefill or capture: the GPT and HYDRA (100M
presets, bf16, batch BATCH (default 1), random weights), each decode mode's step replayed 200 times after its
capture (CUDA events), and the GPU kernel time of the same step run eagerly as stages (profiler:
kernel durations only, no launch gaps), with its 25 costliest kernels. HYDRA with each form of
CCGQA's decode convs (hydra_model.options.decode_conv). Writes $OUT/decode_steady_b{BATCH}.json.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/decode_steady.py

`hydra-diag bench inference` times whole generations (prefill, warm-up and capture included);
this isolates the per-token step that a long generation converges to. Where the step is a
composed graph (graph_compose.py), the same pieces are also timed without the routed blocks and
with them run unconditionally, which brackets what the IF nodes cost. ``TILE=bn,bk`` sets the
window weight's tile for ``window_tiles`` (hydra_model.ccgqa_fold.WINDOW_TILE); ``CONVS`` (comma-
separated) limits the conv forms timed.
"""

import collections
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import StagedDecoder
from hydra_model.graph_compose import ComposedGraph
from hydra_model.options import OPTIONS

PROMPT, CAPACITY, REPLAYS, PROFILED = 64, 600, 200, 20
BATCH = int(os.environ.get("BATCH", "1"))


def step_times(model, dev: torch.device) -> dict:
    """Per mode: ms per replayed step (graphs, masked) and the staged step's kernel profile."""
    prompt = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), device=dev)
    tok = torch.ones(BATCH, dtype=torch.long, device=dev)
    row: dict = {}
    for mode in ("graphs", "masked", "staged"):
        with torch.no_grad():
            cache = ModelCache(capacity=CAPACITY)
            model(prompt, cache=cache)
            dec = StagedDecoder(model, cache, BATCH, dev, mode)
            for _ in range(11):  # the first captures; the rest settle clocks and caches
                dec.step(tok)
            torch.cuda.synchronize()
            if mode == "staged":
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(PROFILED):
                        dec.step(tok)
                    torch.cuda.synchronize()
                us, count = collections.Counter(), collections.Counter()
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        us[e.name[:60]] += e.device_time / PROFILED
                        count[e.name[:60]] += 1 / PROFILED
                row["staged_gpu_us_per_step"] = sum(us.values())
                row["staged_kernels_per_step"] = sum(count.values())
                row["top"] = [(k, round(v, 1), round(count[k], 2)) for k, v in us.most_common(25)]
                continue
            row[f"{mode}_ms_per_step"] = replay_ms(dec.step, tok)
            row[f"{mode}_capture"] = dec.report.capture
            row[f"{mode}_extra"] = dec.report.extra
            if isinstance(dec._step_graph, ComposedGraph):
                row.update(if_node_cost(dec._step_graph))
    return row


def replay_ms(fn, *args) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS


def if_node_cost(step: ComposedGraph) -> dict:
    """What the routing points cost in the composed step: the same captured pieces composed with
    the routed blocks left out (every block skipped, for free: the floor) and with them as plain
    children (every block run, no IF node, no flag kernel). Timing only: these replays advance the
    cache like steps, and their tokens are not read."""
    pieces = step._pieces
    floor = ComposedGraph([(g, None) for g, flag in pieces if flag is None])
    all_run = ComposedGraph([(g, None) for g, _ in pieces])
    return {
        "routed_points": sum(flag is not None for _, flag in pieces),
        "composed_no_routed_ms": replay_ms(floor.replay),
        "composed_all_run_plain_ms": replay_ms(all_run.replay),
    }


def main() -> None:
    out, dev = {}, torch.device("cuda")
    if os.environ.get("TILE"):  # the window weight's tile for window_tiles, e.g. TILE=32,64
        import hydra_model.ccgqa_fold as ccgqa_fold

        ccgqa_fold.WINDOW_TILE = tuple(int(v) for v in os.environ["TILE"].split(","))
        out["window_tile"] = list(ccgqa_fold.WINDOW_TILE)
    for conv in os.environ.get("CONVS", "window_gemm,window_tiles,headwise").split(","):
        OPTIONS.decode_conv = conv
        for cfg in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none"):
            if cfg.arch == "gpt" and conv == "headwise":
                continue  # the GPT has no convs
            torch.manual_seed(0)
            model = build_model(cfg.arch, "100M", **cfg.overrides).to(dev).eval().to(torch.bfloat16)
            if model.rope is not None:
                model.rope.ensure(CAPACITY)
            row = out[f"{cfg.name}/{conv}"] = step_times(model, dev)
            print(cfg.name, conv, {k: v for k, v in row.items() if k != "top"}, flush=True)
            for entry in row["top"]:
                print("   ", entry)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"decode_steady_b{BATCH}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
