"""Where an eager prefill's host time goes, block by block: the GPT's and HYDRA's 100M presets
(bf16, random weights) each prefill a BATCH × 64-token prompt into a fresh cache (what a generate
call that builds its decoder runs) PREFILLS times, the two models' prefills alternating (a lent
machine's host speed drifts: neighbours compare like with like). Each fresh prefill is followed
by one into a restarted cache (``ModelCache.restart``: the conv weights stay folded, as in a
kept decoder's eager prefill). Forward hooks stamp each block's (each layer's) host time; CUDA
events bracket the prefill, so a prefill whose GPU end event comes right after the host returns
is bound by its host. Prints the host and GPU times in order; writes
$OUT/prefill_blocks_b{BATCH}.json (per prefill: host, GPU and done ms, each block's host ms).

    source tools/gpu_env.sh
    BATCH=8 python packages/hydra-diag/bench/prefill_blocks.py
"""

import json
import os
import time

import torch
from single_call_pairs import build_pair  # beside this script

from hydra_model.cache import ModelCache

PROMPT, NEW = 64, 128
BATCH = int(os.environ.get("BATCH", "8"))
PREFILLS = int(os.environ.get("PREFILLS", "40"))


def stamp_blocks(blocks: list[torch.nn.Module], stamps: list) -> None:
    """Append (block, "pre" | "post", host time) to ``stamps`` around each block's forward."""
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: stamps.append((i, "pre", time.perf_counter())))
        block.register_forward_hook(lambda m, a, o, i=i: stamps.append((i, "post", time.perf_counter())))


def timed_prefill(model: torch.nn.Module, prompt: torch.Tensor, stamps: list, cache: ModelCache) -> dict:
    torch.cuda.synchronize()
    stamps.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    model(prompt, cache=cache)
    end.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    entered = {i: t for i, kind, t in reversed(stamps) if kind == "pre"}  # each block's first entry
    blocks = {i: round(1000 * (t - entered[i]), 3) for i, kind, t in stamps if kind == "post"}
    return {
        "host_ms": round(1000 * (t1 - t0), 3), "gpu_ms": round(start.elapsed_time(end), 3),
        "done_ms": round(1000 * (time.perf_counter() - t0), 3), "blocks": blocks,
    }  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    prompt = torch.randint(0, 27000, (BATCH, PROMPT), device=dev)
    models = build_pair(dev)
    stamps: dict[str, list] = {name: [] for name in models}
    for name, model in models.items():
        stamp_blocks(list(getattr(model, "blocks", None) or model.layers), stamps[name])
    res: dict[str, list[dict]] = {f"{name}{kind}": [] for name in models for kind in ("", " restarted")}
    with torch.no_grad():
        for model in models.values():  # kernels compiled and tuned, the attention picks measured
            for _ in range(3):
                model.release_decoder()
                model.generate(prompt, NEW)
            model.release_decoder()
        kept = {name: ModelCache(capacity=PROMPT + NEW) for name in models}
        for name, model in models.items():
            model(prompt, cache=kept[name])
        for _ in range(PREFILLS):
            for name, model in models.items():
                fresh = ModelCache(capacity=PROMPT + NEW)
                res[name].append(timed_prefill(model, prompt, stamps[name], fresh))
                kept[name].restart()  # the conv weights stay folded: a kept decoder's eager prefill
                res[f"{name} restarted"].append(timed_prefill(model, prompt, stamps[name], kept[name]))
    for name, runs in res.items():
        print(name, "host ms in order:", [r["host_ms"] for r in runs])
        print(name, "GPU ms in order: ", [r["gpu_ms"] for r in runs])
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"prefill_blocks_b{BATCH}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "batch": BATCH, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
