"""What trimming the CUDA caching allocator before a decode step's capture costs a single
``generate`` call: the GPT and HYDRA (100M presets, bf16, random weights, 64-token prompt, 128 new
tokens, batch BATCH (8 unless set)), each call building its decoder, with the trim that
``torch.cuda.graph`` does on entry (``torch.cuda.empty_cache`` and the pinned host cache's
``torch._C._host_emptyCache``) put back before the capture (``trim``) or not (``keep``, what
``hydra_model.graph_compose.capture_graphs`` does). Calls alternate trim/keep within one process,
the order flipping every round, PAIRS rounds (15 unless set); prints each model's median ms per
setting and the median paired ratio keep / trim; writes $OUT/capture_trim_ab_b{BATCH}.json. Only
the plain (one-capture) step is switched: HYDRA's step composed through the driver (a torch
without IF nodes in its capture) is captured by ``capture_graphs(..., keep_graph=True)``, which
never trimmed, so its two settings are a control.

    source tools/gpu_env.sh
    BATCH=8 PAIRS=15 python packages/hydra-diag/bench/capture_trim_ab.py
"""

import json
import os
import statistics
import sys
import time

import torch

import hydra_model.decode_graphs as decode_graphs
from hydra_model.graph_compose import capture_graphs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling single_call_pairs.py
from single_call_pairs import build_pair

PROMPT, NEW = 64, 128
BATCH = int(os.environ.get("BATCH", "8"))
PAIRS = int(os.environ.get("PAIRS", "15"))


def trimmed(fns, pool, keep_graph=False):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    return capture_graphs(fns, pool, keep_graph)


def main() -> None:
    dev = torch.device("cuda")
    models = build_pair(dev)
    vocab = min(m.config.vocab_size for m in models.values())
    prompt = torch.randint(0, vocab, (BATCH, PROMPT), device=dev)
    ms = {f"{name}_{how}": [] for name in models for how in ("trim", "keep")}
    with torch.no_grad():
        for model in models.values():
            for _ in range(2):
                model.generate(prompt, NEW)
        for r in range(PAIRS):
            for name, model in models.items():
                for how in ("trim", "keep") if r % 2 == 0 else ("keep", "trim"):
                    decode_graphs.capture_graphs = trimmed if how == "trim" else capture_graphs
                    model.release_decoder()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    model.generate(prompt, NEW)
                    torch.cuda.synchronize()
                    ms[f"{name}_{how}"].append(1000.0 * (time.perf_counter() - start))
    decode_graphs.capture_graphs = capture_graphs
    summary = {"device": torch.cuda.get_device_name(), "batch": BATCH, "pairs": PAIRS, "ms": ms}
    for name in models:
        keep, trim = ms[f"{name}_keep"], ms[f"{name}_trim"]
        summary[name] = {
            "keep_ms_median": statistics.median(keep), "trim_ms_median": statistics.median(trim),
            "keep_over_trim_median": statistics.median(k / t for k, t in zip(keep, trim, strict=True)),
        }  # fmt: skip
        print(name, {k: round(v, 3) for k, v in summary[name].items()})
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"capture_trim_ab_b{BATCH}.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
