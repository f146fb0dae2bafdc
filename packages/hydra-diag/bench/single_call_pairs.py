"""Single ``generate`` calls of the GPT and HYDRA (100M presets, bf16, random weights, 64-token
prompt, NEW new tokens (128 unless set), batch BATCH) interleaved call by call in one process,
each call building its decoder (the kept one released first); the order flips every round. Each
round gives a paired ratio GPT ms / HYDRA ms (HYDRA's tokens/s over the GPT's): on a lent machine
whose host speed drifts by 10–30% between processes, pairs of neighbouring calls compare like with
like, where first_call_phases.py times all of one model's calls before the other's. Prints the
median ratio and its quartiles; writes $OUT/single_call_pairs_b{BATCH}.json (``_n{NEW}`` added to
the name when NEW is set, ``_{DECODE}`` when DECODE names a decode mode other than auto: both
models' ``generate(decode=DECODE)``).

    source tools/gpu_env.sh
    BATCH=1 PAIRS=15 python packages/hydra-diag/bench/single_call_pairs.py
    BASE=bench_base SCRIPT=single_call_pairs.py bash packages/hydra-diag/bench/first_call_ab.sh
"""

import json
import os
import statistics
import time

import torch

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model

PROMPT = 64
NEW = int(os.environ.get("NEW", "128"))
BATCH = int(os.environ.get("BATCH", "1"))
PAIRS = int(os.environ.get("PAIRS", "15"))
DECODE = os.environ.get("DECODE", "auto")


def quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[round(p * (len(ordered) - 1))]


def build_pair(device: torch.device) -> dict[str, torch.nn.Module]:
    """The race's ``gpt`` and ``hydra`` at the 100M preset (seed 0), in evaluation mode and bf16
    on ``device`` (also used by kept_decoder_prompts.py and prefill_blocks.py beside this one)."""
    models = {}
    for cfg in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none"):
        torch.manual_seed(0)
        models[cfg.name] = build_model(cfg.arch, "100M", **cfg.overrides).to(device).eval().to(torch.bfloat16)
    return models


def main() -> None:
    dev = torch.device("cuda")
    models = build_pair(dev)
    vocab = min(m.config.vocab_size for m in models.values())
    prompt = torch.randint(0, vocab, (BATCH, PROMPT), device=dev)
    ms: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():  # kernels compiled, autotuned, probes run
            for _ in range(2):
                model.generate(prompt, NEW, decode=DECODE)
        for r in range(PAIRS):
            for name in ("gpt", "hydra") if r % 2 == 0 else ("hydra", "gpt"):
                model = models[name]
                model.release_decoder()
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(prompt, NEW, decode=DECODE)
                torch.cuda.synchronize()
                ms[name].append(1000.0 * (time.perf_counter() - start))
                assert not model.last_decode_report.reused, model.last_decode_report
    ratios = [g / h for g, h in zip(ms["gpt"], ms["hydra"], strict=True)]
    summary = {
        "device": torch.cuda.get_device_name(), "batch": BATCH, "new_tokens": NEW, "pairs": PAIRS,
        "decode": DECODE,
        "gpt_ms_median": statistics.median(ms["gpt"]), "hydra_ms_median": statistics.median(ms["hydra"]),
        "ratio_median": statistics.median(ratios), "ratio_q25": quantile(ratios, 0.25),
        "ratio_q75": quantile(ratios, 0.75), "ms": ms,
    }  # fmt: skip
    print({k: round(v, 3) for k, v in summary.items() if isinstance(v, float)})
    print(f"single call, batch {BATCH}, {NEW} new tokens, decode {DECODE}: "
          f"hydra / gpt = {summary['ratio_median']:.3f} "
          f"(quartiles {summary['ratio_q25']:.3f}-{summary['ratio_q75']:.3f})")  # fmt: skip
    suffix = (f"_n{NEW}" if "NEW" in os.environ else "") + (f"_{DECODE}" if DECODE != "auto" else "")
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, f"single_call_pairs_b{BATCH}{suffix}.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
