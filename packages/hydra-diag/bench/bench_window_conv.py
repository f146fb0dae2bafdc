"""CCGQA's decode window conv alone on one GPU: the 100M preset's [C, K·C] window weight of one
block (random weights, bf16, batch 1 and 8), as cuBLAS runs it (``F.linear`` with the bias, and
``torch.mm`` without) and as hydra_kernels' ``tile_linear`` over its non-zero tiles at several tile
sizes. Each variant: 200 calls captured in one CUDA graph, replayed, CUDA events, µs per call.
Writes $OUT/bench_window_conv.json.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/bench_window_conv.py
"""

import json
import os

import torch
import torch.nn.functional as F

from hydra_kernels.ops.tile_linear import pack_tiles, tile_linear
from hydra_model import build_model

CALLS = 200
TILES = ((64, 64), (32, 64), (16, 64), (32, 32))


def graph_us(fn) -> float:
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000.0 * start.elapsed_time(end) / CALLS


def main() -> None:
    torch.manual_seed(0)
    model = build_model("hydra", "100M").cuda().eval().to(torch.bfloat16)
    attn = model.blocks[1].mor.block.attn
    with torch.no_grad():
        weight, bias = attn._build_folded("window")
    rows = []
    for batch in (1, 8):
        x = torch.randn(batch, weight.shape[1], dtype=weight.dtype, device="cuda")
        want = F.linear(x.float(), weight.float(), bias.float())
        row = {"batch": batch, "shape": list(weight.shape), "nonzero": float((weight != 0).float().mean())}
        row["F.linear+bias"] = graph_us(lambda x=x: F.linear(x, weight, bias))
        row["mm"] = graph_us(lambda x=x: torch.mm(x, weight.t()))
        for bn, bk in TILES:
            packed = pack_tiles(weight, bn, bk)
            err = float((tile_linear(x, packed, bias).float() - want).abs().max())
            row[f"tiles {bn}x{bk}"] = graph_us(lambda x=x, p=packed: tile_linear(x, p, bias))
            row[f"tiles {bn}x{bk} nnz, max err"] = [packed.index.shape[1], err]
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "bench_window_conv.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
