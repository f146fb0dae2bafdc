"""Run ``hydra-train`` in this process and, when it exits, write torch.compile's own account of
where the compile went: dynamo's table of timed phases (tracing, AOTAutograd's joint graph, the
inductor forward and backward compiles, ...) summed over every graph, and torch's cache counters
(``aot_autograd``: hits, misses, bypasses; ``inductor``: the FX graph cache). A warm run whose
``aot_autograd`` counters say "bypass" traced its joint graph again.

    source tools/gpu_env.sh
    CT_OUT=ct.txt python packages/hydra-diag/bench/compile_times.py run --model_size 100M \\
        --compile --compile_scope model --batch_size 8 --seq_len 2048 --max_steps 80 --save_every 0
"""

import atexit
import os
import runpy
import sys


def write_report() -> None:
    import torch._dynamo.utils as dynamo_utils

    counters = {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("aot_autograd", "inductor")}
    with open(os.environ.get("CT_OUT", "compile_times.txt"), "w") as f:
        f.write(dynamo_utils.compile_times(repr="str", aggregate=True))
        f.write(f"\ncounters: {counters!r}\n")


if __name__ == "__main__":
    atexit.register(write_report)
    sys.argv = ["hydra_train", *sys.argv[1:]]
    runpy.run_module("hydra_train", run_name="__main__", alter_sys=True)
