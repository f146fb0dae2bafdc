"""What a training step asks of the compiler and the GPU, counted on the CPU: the ops Dynamo traces
for the training forward (torch.compile's graph, which its compile time grows with), the kernels an
eager forward + backward launches, and the kernels of the causal thresholds' commit (which
hydra-train runs after the optimizer, inside its CUDA-graphed step).

    python packages/hydra-diag/bench/train_counts.py --configs gpt,hydra --out counts.json
    python packages/hydra-diag/bench/train_counts.py --configs hydra --set '*.dim=192' --seq_len 32

Each configuration is built as ``hydra-diag race`` builds it (random weights, training mode).
Kernels are counted as a GPU would launch them (hydra_kernels.launch_count: hydra_kernels' Triton
ops, run by Triton's interpreter, one launch each; aten operators that launch a kernel one each;
views and metadata none). ``--set '*.dim=192'`` narrows the model (the counts do not depend on the
width; the interpreter's time does). The traced ops are Dynamo's ``calls_captured`` for the forward
with its loss (no backend: the graph is only captured), kernels on or off as ``--kernels`` says.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before triton is imported: kernels on the CPU (not when imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json

import torch

import hydra_kernels
from hydra_kernels.launch_count import KernelCount
from hydra_model import build_model


def traced_ops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int, int]:
    """(ops Dynamo captures for ``model(x, targets=y)``, graphs, graph breaks)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=capture, dynamic=False)(x, targets=y)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return int(torch._dynamo.utils.counters["stats"]["calls_captured"]), len(graphs), breaks


def count(arch: str, size: str, overrides: dict, batch: int, seq_len: int) -> dict:
    torch.manual_seed(0)
    model = build_model(arch, size, **overrides).train()
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq_len))
    y = torch.randint(0, vocab, (batch, seq_len))
    if hasattr(model, "threshold_commit"):
        model.threshold_commit = "manual"  # as hydra-train's trainer sets it: commits counted apart
    ops, graphs, breaks = traced_ops(model, x, y)
    model(x, targets=y).loss.backward()  # lazily built state first
    model.zero_grad(set_to_none=True)
    with KernelCount() as fwd:
        out = model(x, targets=y)
    with KernelCount() as bwd:
        out.loss.backward()
    row = {
        "traced_ops": ops,
        "graphs": graphs,
        "graph_breaks": breaks,
        "forward_kernels": sum(fwd.kernels.values()),
        "backward_kernels": sum(bwd.kernels.values()),
        "forward_by_kernel": dict(fwd.kernels.most_common()),
    }
    if hasattr(model, "commit_router_thresholds"):
        with KernelCount() as commit:
            model.commit_router_thresholds(torch.tensor(True))
        row["commit_kernels"] = sum(commit.kernels.values())
        row["routing_points"] = len(model.router_thresholds())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gpt,hydra", help="race configurations, comma-separated")
    ap.add_argument("--model_size", default="100M")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], help="as hydra-diag race's (e.g. *.dim=192)")
    ap.add_argument("--kernels", default="on", choices=["on", "off"], help="hydra_kernels' Triton ops")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    from hydra_diag.race.configs import parse_config_names, parse_sets, resolve_configs

    hydra_kernels.set_use_triton_kernels(args.kernels == "on")
    rows = []
    sets = parse_sets(args.set)
    for cfg in resolve_configs(parse_config_names(args.configs), sets, lr=1.0, compile_default="none"):
        row = count(cfg.arch, args.model_size, cfg.overrides, args.batch, args.seq_len)
        rows.append({"config": cfg.name, **row})
    print(f"{'config':<12} {'traced ops':>10} {'fwd kernels':>11} {'bwd kernels':>11} {'commit':>7}")
    for r in rows:
        commit = f"{r['commit_kernels']:>7}" if "commit_kernels" in r else f"{'-':>7}"
        kernels = f"{r['forward_kernels']:>11} {r['backward_kernels']:>11}"
        print(f"{r['config']:<12} {r['traced_ops']:>10} {kernels} {commit}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_size": args.model_size, "batch": args.batch, "seq_len": args.seq_len,
                       "set": args.set, "kernels": args.kernels, "rows": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
