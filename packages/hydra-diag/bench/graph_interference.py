"""Does a CUDA graph with conditional (IF) nodes slow the other graphs of its process? The dense
GPT's graphed decode step (100M preset, bf16, batch 1) timed alone, after the driver probe of
composed IF graphs (which builds and frees one), while a HYDRA decoder's composed step is alive,
and after that decoder is freed. (A GPT built after HYDRA stepped ~12% slower in
decode_steady.py; packages/hydra-model/BENCHMARKS.md.) Writes $OUT/graph_interference.json.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/graph_interference.py
"""

import gc
import json
import os

import torch
from decode_steady import replay_ms  # this folder's script (on sys.path when run as one)

from hydra_diag.race.configs import parse_config_names, resolve_configs
from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import StagedDecoder
from hydra_model.graph_compose import driver_conditional_fail

PROMPT, CAPACITY = 64, 2048  # room for 11 + 5 × 200 steps after the prompt


def decoder(model, dev):
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), device=dev)
    cache = ModelCache(capacity=CAPACITY)
    with torch.no_grad():
        model(prompt, cache=cache)
        dec = StagedDecoder(model, cache, 1, dev, "graphs")
        tok = torch.ones(1, dtype=torch.long, device=dev)
        for _ in range(11):  # warm-up and capture, then settle
            dec.step(tok)
    return dec, tok


def step_ms(dec, tok) -> float:
    return replay_ms(dec.step, tok)  # decode_steady.py's timing: REPLAYS steps, CUDA events


def main() -> None:
    dev, out = torch.device("cuda"), {}
    cfgs = {
        c.name: c
        for c in resolve_configs(parse_config_names("gpt,hydra"), [], lr=1.0, compile_default="none")
    }
    torch.manual_seed(0)
    gpt = build_model("gpt", "100M", **cfgs["gpt"].overrides).to(dev).eval().to(torch.bfloat16)
    gpt.rope.ensure(CAPACITY)
    gdec, gtok = decoder(gpt, dev)
    out["gpt_alone"] = step_ms(gdec, gtok)
    out["probe"] = driver_conditional_fail(dev)
    gc.collect()
    out["gpt_after_probe"] = step_ms(gdec, gtok)
    hydra = build_model("hydra", "100M", **cfgs["hydra"].overrides).to(dev).eval().to(torch.bfloat16)
    hydra.rope.ensure(CAPACITY)
    hdec, htok = decoder(hydra, dev)
    out["hydra_capture"] = hdec.report.capture
    out["gpt_with_hydra_decoder"] = step_ms(gdec, gtok)
    out["hydra"] = step_ms(hdec, htok)
    out["gpt_with_hydra_decoder_again"] = step_ms(gdec, gtok)
    del hdec
    gc.collect()
    torch.cuda.synchronize()
    out["gpt_after_hydra_freed"] = step_ms(gdec, gtok)
    print(out, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "graph_interference.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **out}, f, indent=1)


if __name__ == "__main__":
    main()
