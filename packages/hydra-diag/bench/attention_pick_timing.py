"""auto's attention candidates timed both ways, REPS times at the 100M preset's two attention
shapes (8 x 2048 full length, 8 x 256 a routed block's rows; 12 query and 4 kv heads of 64, bf16,
causal, forward + backward): eagerly (CUDA events around each call, host included: how auto
measured before 2026-11-26) and by GPU time (``_gpu_ms``: calls queued behind a spin kernel, how
it measures now), with the candidate each way would pick. Writes $OUT/attention_pick_timing.json.

    source tools/gpu_env.sh
    REPS=5 python packages/hydra-diag/bench/attention_pick_timing.py
"""

import json
import os

import torch

import hydra_model.attention_backend as ab

NAMES = ("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_cudnn+expand", "sdpa_flash+expand")


def main() -> None:
    dev, out = torch.device("cuda"), {}
    for b, s in ((8, 2048), (8, 256)):
        q = torch.randn(b, 12, s, 64, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(b, 4, s, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
        candidates = {n: f for n, f in ab._candidates(q, k).items() if n in NAMES}
        rows = []
        for _ in range(int(os.environ.get("REPS", "5"))):
            eager, gpu = {}, {}
            for name, impl in candidates.items():
                ab._time_calls(eager, name, impl, (q, k, v), True, None, True, True)
                gpu[name] = ab._gpu_ms(impl, (q, k, v), True, None, True)[0]
            row = {"eager": eager, "gpu": gpu, "eager_pick": min(eager, key=eager.get)}
            row["gpu_pick"] = min(gpu, key=gpu.get)
            rows.append(row)
            print(f"{b}x{s}", json.dumps(row), flush=True)
        out[f"{b}x{s}"] = rows
    with open(os.path.join(os.environ.get("OUT", "."), "attention_pick_timing.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
