"""A single ``generate`` call's parts for the GPT and HYDRA (100M presets, bf16, random weights,
64-token prompt, 128 new tokens, batch BATCH), in one process, one model after the other: the host
time of ten eager prefills into fresh caches (launched, and done), five single calls (each releases
the kept decoder first, so it prefills, captures and decodes), the last call's capture time from
its report, and a cProfile of one more call ($OUT/profile_{model}_b{BATCH}.txt). The models are not
interleaved, so the call times carry the host's drift between them; single_call_pairs.py is the
figure for the ratio. Writes $OUT/phases_b{BATCH}.json.

    source tools/gpu_env.sh
    BATCH=8 python packages/hydra-diag/bench/single_call_parts.py
"""

import cProfile
import io
import json
import os
import pstats
import time

import torch

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model
from hydra_model.cache import ModelCache

PROMPT, NEW = 64, 128
OUT = os.environ.get("OUT", "/tmp")
BATCH = int(os.environ.get("BATCH", "8"))


def parts(model, prompt: torch.Tensor) -> dict:
    for _ in range(3):  # kernels compiled and tuned, probes run, the step's signature warm
        model.release_decoder()
        model.generate(prompt, NEW)
    prefill = []
    for _ in range(10):
        cache = ModelCache(capacity=PROMPT + NEW)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(prompt, cache=cache)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        prefill.append((1000 * (launched - start), 1000 * (time.perf_counter() - start)))
    calls = []
    for _ in range(5):
        model.release_decoder()
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, NEW)
        torch.cuda.synchronize()
        calls.append(1000 * (time.perf_counter() - start))
    report = model.last_decode_report
    return {
        "prefill_host_ms": sorted(p[0] for p in prefill),
        "prefill_done_ms": sorted(p[1] for p in prefill),
        "call_ms": sorted(calls),
        "capture_ms": report.capture_ms,
        "report": report.to_dict(),
    }


def profiled_call(model, prompt: torch.Tensor, path: str) -> None:
    model.release_decoder()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    model.generate(prompt, NEW)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    with open(path, "w") as f:
        f.write(text.getvalue())


def main() -> None:
    dev, res = torch.device("cuda"), {}
    prompt = torch.randint(0, 27000, (BATCH, PROMPT), device=dev)
    for cfg in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none"):
        torch.manual_seed(0)
        model = build_model(cfg.arch, "100M", **cfg.overrides).to(dev).eval().to(torch.bfloat16)
        with torch.no_grad():
            res[cfg.name] = parts(model, prompt)
            profiled_call(model, prompt, os.path.join(OUT, f"profile_{cfg.name}_b{BATCH}.txt"))
        del model
    print(json.dumps({n: {k: v for k, v in r.items() if k != "report"} for n, r in res.items()}, indent=1))
    with open(os.path.join(OUT, f"phases_b{BATCH}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
