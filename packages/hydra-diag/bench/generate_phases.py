"""Where a whole generation's time goes on one GPU: the GPT and HYDRA (100M presets, bf16, batch 1,
random weights, 64-token prompt, 128 new tokens), each phase timed alone after warm-up (medians of
REPEATS, host clock around a device sync): the weights' fingerprint computed eagerly and replayed
as the held decoder's graph (hydra_model/decoder_hold.py), the prompt's eager prefill forward, and
a whole ``generate`` with its decoder kept from the call before (its prefill a replayed graph
after the first two calls); then ROUNDS rounds of kept generations, the two models interleaved
(each a median of REPEATS), and their per-round ratio. Writes $OUT/generate_phases.json.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/generate_phases.py
"""

import json
import os
import statistics
import time

import torch

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.decoder_hold import model_fingerprint

PROMPT, NEW, REPEATS, ROUNDS = 64, 128, 7, 9


def timed_ms(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times)


def prefill(model, prompt) -> None:
    model(prompt, cache=ModelCache(capacity=PROMPT + NEW))


def phases(model, prompt) -> dict:
    with torch.no_grad():
        model.generate(prompt, NEW)  # warm-up: kernels, autotuning, the decoder kept
        row = {
            "fingerprint_ms": timed_ms(model_fingerprint, model),
            "prefill_ms": timed_ms(prefill, model, prompt),
            "generate_kept_ms": timed_ms(model.generate, prompt, NEW),
            "fingerprint_graph_ms": timed_ms(model._decoder_hold.held.fingerprint.content),
        }
    row["reused"] = model.last_decode_report.reused
    row["prefill"] = model.last_decode_report.prefill
    return row


def rounds(models: dict, prompts: dict) -> dict:
    """Kept-decoder generations interleaved, model after model, ROUNDS times: each round's
    tokens/s per model and their ratio (a drift of the machine hits both alike)."""
    out: dict = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(ROUNDS):
            for name, model in models.items():
                out[name].append(NEW / (timed_ms(model.generate, prompts[name], NEW) / 1000.0))
    return out


def main() -> None:
    dev, rows, models, prompts = torch.device("cuda"), {}, {}, {}
    for cfg in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none"):
        torch.manual_seed(0)
        model = build_model(cfg.arch, "100M", **cfg.overrides).to(dev).eval().to(torch.bfloat16)
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), device=dev)
        models[cfg.name], prompts[cfg.name] = model, prompt
        row = rows[cfg.name] = phases(model, prompt)
        print(cfg.name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    per_round = rounds(models, prompts)
    ratios = [h / g for h, g in zip(per_round["hydra"], per_round["gpt"], strict=True)]
    summary = {"tokens_per_s": per_round, "hydra_over_gpt": ratios, "median_ratio": statistics.median(ratios)}
    print("rounds (tokens/s):", {k: [round(v) for v in vs] for k, vs in per_round.items()})
    median = round(summary["median_ratio"], 3)
    print("hydra / gpt per round:", [round(r, 3) for r in ratios], "median", median)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "generate_phases.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "rounds": summary}, f, indent=1)


if __name__ == "__main__":
    main()
