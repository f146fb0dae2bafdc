"""``generate`` calls with the decoder kept (the default), the GPT's and HYDRA's interleaved call by
call in one process (100M presets, bf16, random weights, NEW new tokens, batch BATCH), in two phases:

* ``same``: every call has a prompt of the first of LENGTHS tokens. Both models reuse their kept
  decoder; the calls differ between trees only by the cache capacity a step reads (a tree that
  rounds it up to a bucket reads the bucket).
* ``varied``: the prompt length cycles through LENGTHS (40, 50, 60 unless set), the same
  max_new_tokens each call, as in an evaluation loop over prompts of different lengths. A tree
  whose kept decoder serves one total length rebuilds and captures a decoder each call; one that
  rounds the cache up to a bucket reuses it.

Prints, per phase, each model's median ms and the median of the paired ratios GPT ms / HYDRA ms
(HYDRA's tokens/s over the GPT's), and how many calls reused their decoder; writes
$OUT/kept_decoder_prompts_b{BATCH}.json.

    source tools/gpu_env.sh
    BATCH=8 ROUNDS=12 python packages/hydra-diag/bench/kept_decoder_prompts.py
"""

import json
import os
import statistics
import time

import torch
from single_call_pairs import build_pair, quantile  # beside this script

NEW = int(os.environ.get("NEW", "128"))
BATCH = int(os.environ.get("BATCH", "8"))
ROUNDS = int(os.environ.get("ROUNDS", "12"))
LENGTHS = [int(n) for n in os.environ.get("LENGTHS", "40,50,60").split(",")]
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: a smoke test of the script (staged decoding)
DECODE = "auto" if DEVICE == "cuda" else "staged"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_calls(models: dict, prompts: list[torch.Tensor]) -> dict:
    """One call a model a round, the order flipping each round, prompt ``prompts[r % len]``."""
    ms: dict[str, list[float]] = {name: [] for name in models}
    reused = dict.fromkeys(models, 0)
    for r in range(ROUNDS):
        prompt = prompts[r % len(prompts)]
        for name in ("gpt", "hydra") if r % 2 == 0 else ("hydra", "gpt"):
            model = models[name]
            sync()
            start = time.perf_counter()
            model.generate(prompt, NEW, decode=DECODE)
            sync()
            ms[name].append(1000.0 * (time.perf_counter() - start))
            reused[name] += bool(model.last_decode_report.reused)
    ratios = [g / h for g, h in zip(ms["gpt"], ms["hydra"], strict=True)]
    return {
        "gpt_ms_median": statistics.median(ms["gpt"]), "hydra_ms_median": statistics.median(ms["hydra"]),
        "ratio_median": statistics.median(ratios), "ratio_q25": quantile(ratios, 0.25),
        "ratio_q75": quantile(ratios, 0.75), "reused": reused, "calls": ROUNDS, "ms": ms,
    }  # fmt: skip


def main() -> None:
    dev = torch.device(DEVICE)
    models = build_pair(dev)
    vocab = min(m.config.vocab_size for m in models.values())
    prompts = [torch.randint(0, vocab, (BATCH, n), device=dev) for n in LENGTHS]
    summary: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    summary |= {"batch": BATCH, "new_tokens": NEW, "lengths": LENGTHS, "rounds": ROUNDS}
    with torch.no_grad():
        for model in models.values():  # kernels compiled and tuned, every length's decoder warm
            for prompt in prompts + prompts:
                model.generate(prompt, NEW, decode=DECODE)
        summary["same"] = timed_calls(models, prompts[:1])
        summary["varied"] = timed_calls(models, prompts)
    for phase in ("same", "varied"):
        s = summary[phase]
        print(
            f"{phase:>6}, batch {BATCH}: gpt {s['gpt_ms_median']:.2f} ms,"
            f" hydra {s['hydra_ms_median']:.2f} ms,"
            f" hydra / gpt = {s['ratio_median']:.3f} ({s['ratio_q25']:.3f}-{s['ratio_q75']:.3f});"
            f" reused {s['reused']['gpt']}/{ROUNDS} gpt, {s['reused']['hydra']}/{ROUNDS} hydra"
        )
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"kept_decoder_prompts_b{BATCH}.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
