"""A prefill into a new cache: HYDRA's 100M preset (bf16, random weights, a 64-token prompt at
batch 1 and 8) after three warm-up prefills; the peak memory allocated above what the model holds,
and the median host and GPU (CUDA events) ms of 20 prefills. Prints one JSON line, tagged with the
first argument (which tree ran it, for an A/B with PYTHONPATH pointing at another tree).

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/prefill_memory.py new
"""

import json
import sys
import time

import torch

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model
from hydra_model.cache import ModelCache


def measure(model, prompt: torch.Tensor) -> dict:
    for _ in range(3):
        model(prompt, cache=ModelCache(capacity=192))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(prompt, cache=ModelCache(capacity=192))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    host, gpu = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        model(prompt, cache=ModelCache(capacity=192))
        ended.record()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        host.append(1000 * (launched - start))
        gpu.append(began.elapsed_time(ended))
    return {
        "peak_MiB_above": peak / 2**20,
        "host_ms_median": sorted(host)[10],
        "gpu_ms_median": sorted(gpu)[10],
    }


def main() -> None:
    cfg = resolve_configs(parse_config_names("hydra"), [], lr=1.0, compile_default="none")[0]
    torch.manual_seed(0)
    model = build_model(cfg.arch, "100M", **cfg.overrides).cuda().eval().to(torch.bfloat16)
    res = {}
    with torch.no_grad():
        for batch in (1, 8):
            res[f"b{batch}"] = measure(model, torch.randint(0, 27000, (batch, 64), device="cuda"))
    print(sys.argv[1] if len(sys.argv) > 1 else "this tree", json.dumps(res))


if __name__ == "__main__":
    main()
