"""What the node kinds of a composed decode graph (hydra_model/graph_compose.py) cost on the GPU.

Ten pieces of ten tiny kernels each (an in-place add on a [8, 768] bf16 tensor), replayed 2000
times after 50 untimed replays, µs per replay from CUDA events:

* ``one_graph``: all 100 kernels in one torch graph;
* ``plain_children``: the ten pieces as child-graph nodes of a driver-built graph;
* ``if_false`` / ``if_true``: every other piece under an IF node on a flag, as a decode step's
  routed blocks are (with the flag-to-handle kernel before each), the flag cleared / set;
* ``half_plain``: the five ungated pieces alone (what ``if_false`` runs);
* ``if_default{0,1}_no_setif``: the IF nodes on handles that take a default value at each launch,
  no flag-to-handle kernel (what the IF node costs without it).

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/if_node_cost.py      # writes $OUT/if_bench.json
"""

import json
import os
from ctypes import byref, c_uint64, c_void_p

import torch

from hydra_model.graph_compose import ComposedGraph, add_if_node, capture_graphs, driver

dev = torch.device("cuda")
K = 10  # kernels per piece
PIECES = 10
x = torch.zeros(8, 768, device=dev, dtype=torch.bfloat16)
flag = torch.zeros((), dtype=torch.bool, device=dev)


def piece():
    for _ in range(K):
        x.add_(1)


for _ in range(3):
    piece()
torch.cuda.synchronize()


def timed(replay, n=2000):
    for _ in range(50):
        replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1000  # µs


def kept(n):
    return capture_graphs([piece] * n, torch.cuda.graph_pool_handle(), keep_graph=True)


res = {}
# one torch graph of all kernels
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(PIECES):
        piece()
res["one_graph_us"] = timed(g.replay)
# plain child graphs only
cg = ComposedGraph([(gr, None) for gr in kept(PIECES)])
res["plain_children_us"] = timed(cg.replay)
# alternate: plain, gated (flag false / true)
pieces = kept(PIECES)
cg2 = ComposedGraph([(gr, flag if i % 2 else None) for i, gr in enumerate(pieces)])
flag.fill_(False)
res["if_false_us"] = timed(cg2.replay)
flag.fill_(True)
res["if_true_us"] = timed(cg2.replay)
# half the pieces only, plain (what if_false runs)
cg3 = ComposedGraph([(gr, None) for gr in kept(PIECES // 2)])
res["half_plain_us"] = timed(cg3.replay)

# IF node with a default-value handle, no set-if kernel
drv = driver()


def compose_default(pieces_flags, default):
    parent, exe = c_void_p(), c_void_p()
    ctx = c_void_p()
    drv.call("cuCtxGetCurrent", byref(ctx))
    drv.call("cuGraphCreate", byref(parent), 0)
    prev = None
    for graph, gated in pieces_flags:
        raw = c_void_p(graph.raw_cuda_graph())
        if not gated:
            node = c_void_p()
            deps, n = (byref(prev), 1) if prev is not None else (None, 0)
            drv.call("cuGraphAddChildGraphNode", byref(node), parent, deps, n, raw)
            prev = node
            continue
        handle = c_uint64()  # flags 1: the handle takes ``default`` at each launch
        drv.call("cuGraphConditionalHandleCreate", byref(handle), parent, ctx, default, 1)
        node, body = add_if_node(parent, prev, handle, ctx)
        child = c_void_p()
        drv.call("cuGraphAddChildGraphNode", byref(child), body, None, 0, raw)
        prev = node
    drv.call("cuGraphInstantiateWithFlags", byref(exe), parent, 0)
    stream = torch.cuda.current_stream().cuda_stream
    return lambda: drv.call("cuGraphLaunch", exe, c_void_p(stream)), (parent, exe)


for default in (0, 1):
    try:
        run, keep = compose_default([(gr, i % 2 == 1) for i, gr in enumerate(kept(PIECES))], default)
        res[f"if_default{default}_no_setif_us"] = timed(run)
    except Exception as err:
        res[f"if_default{default}_no_setif_us"] = f"{type(err).__name__}: {err}"
res["gated"] = PIECES // 2
res["kernels_per_piece"] = K
print(json.dumps(res, indent=1))
with open(os.path.join(os.environ.get("OUT", "/tmp"), "if_bench.json"), "w") as f:
    json.dump(res, f, indent=1)
