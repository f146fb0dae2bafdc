"""Whether torch's AOTAutograd cache takes a compiled HYDRA training step whose attention runs a
restricted SDPA kernel (the traced ``sdpa_kernel`` context), on CUDA: the debug preset, fp32,
one compiled forward and backward, with ``HYDRA_SDPA_NO_FLASH=1`` (a restricted pick always) or
``AUTO=1`` (auto after an eager step; in fp32 it picks a restricted kernel). Run it twice on one
``TORCHINDUCTOR_CACHE_DIR``: the second run should count ``autograd_cache_hit``, not ``bypass``.
Prints one JSON line: the AOTAutograd counters and the first step's seconds.

    source tools/gpu_env.sh
    export TORCHINDUCTOR_CACHE_DIR=/tmp/sc/i TRITON_CACHE_DIR=/tmp/sc/t
    HYDRA_SDPA_NO_FLASH=1 python packages/hydra-diag/bench/sdpa_cache_check.py cold
    HYDRA_SDPA_NO_FLASH=1 python packages/hydra-diag/bench/sdpa_cache_check.py warm
"""

import json
import os
import sys
import time

import torch
from torch._dynamo.utils import counters

from hydra_model import attention_backend, build_model


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if os.environ.get("AUTO"):
        attention_backend.set_attention_backend("auto")
    model = build_model("hydra", "debug").to(dev).train()
    model.threshold_commit = "manual"
    x, y = (torch.randint(0, 4096, (2, 256), device=dev) for _ in range(2))
    if os.environ.get("AUTO"):  # auto measures on eager calls; the compile takes its pick
        model(x, targets=y).loss.backward()
        model.zero_grad()
    compiled = torch.compile(model)
    start = time.perf_counter()
    compiled(x, targets=y).loss.backward()
    torch.cuda.synchronize()
    seconds = round(time.perf_counter() - start, 2)
    picks = {str(k): v for k, v in attention_backend._auto_choice.items()}
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    aot = dict(counters["aot_autograd"])
    print(json.dumps({"tag": tag, "aot": aot, "first_step_s": seconds, "auto_picks": picks}))


if __name__ == "__main__":
    main()
