"""Kernels one decode step launches, counted on the CPU: what a graphed decode step on a GPU
replays, without a GPU.

    python packages/hydra-diag/bench/decode_kernels.py --configs gpt,hydra --out k.json

At batch 1 a decode step of a 100M model is bound by kernel launches, not by arithmetic (an H100
replayed the GPT's graphed step at about 4 µs a kernel, packages/hydra-model/BENCHMARKS.md), so the
count is the first figure to move. Each configuration (as ``hydra-diag race`` builds it, random
weights) prefills a prompt, then runs one decode step as the stages a graphed decoder captures
(hydra_model/decode_graphs.py), every stage once, in bf16 by default as on a GPU (the casts an fp32
model would not need are kernels too). Counted as a GPU would launch them:
hydra_kernels' Triton ops (run by Triton's interpreter) one launch each, the aten operators that
launch a kernel one each; views, metadata and host-side work none. The routed blocks are counted
apart: a step runs the plain stages always and a routed block only for a token it takes.
``prefill``: the kernels of the prompt's eager prefill into a fresh cache (a single generate
call's: its conv weights built), at ``--prompt_len`` tokens; ``--prefill_batch B`` counts it at
batch B as well (``prefill_bB``).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before triton is imported: kernels on the CPU (not when imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import collections
import json

import torch

import hydra_kernels
from hydra_kernels.launch_count import KernelCount
from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import StagedDecoder
from hydra_model.fused_decide import fused_decide


def count_decode_step(
    arch: str,
    model_size: str,
    overrides: dict,
    prompt_len: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    decide: str = "on",
) -> dict:
    """Kernels of one decode step at batch 1 of a ``dtype`` model, by segment kind (plain, each
    routed block). ``decide``: hydra_model.fused_decide's mode; a GPU fuses a routed block's
    decision into one kernel ("auto" there), "on" does so on these CPU tensors too."""
    model, prompt = _model_and_prompt(arch, model_size, overrides, dtype, 1, prompt_len)
    capacity = prompt_len + 4
    if model.rope is not None:
        model.rope.ensure(capacity)
    plain: collections.Counter[str] = collections.Counter()
    routed = []
    with torch.no_grad(), fused_decide(decide):
        cache = ModelCache(capacity=capacity)
        with KernelCount() as prefill:  # a single call's prefill: eager, its conv weights built
            model(prompt, cache=cache)
        decoder = StagedDecoder(model, cache, 1, prompt.device, "staged")
        decoder.step(torch.tensor([1]))  # the first step builds the per-generation constants
        for segment in decoder.segments:  # of every block: a staged step skips the routed ones
            segment.run_stages()  # that its token did not take (a graphed warm-up runs them all)
        for segment in decoder.segments:
            with KernelCount() as counter:
                for stage in segment.stages:
                    stage.run()
            if segment.gated:
                routed.append(sum(counter.kernels.values()))
            else:
                plain.update(counter.kernels)
    return {
        "prefill": sum(prefill.kernels.values()),
        "plain": sum(plain.values()),
        "routed_blocks": routed,
        "all_blocks_run": sum(plain.values()) + sum(routed),
        "plain_by_kernel": dict(plain.most_common()),
    }


def _model_and_prompt(
    arch: str, model_size: str, overrides: dict, dtype: torch.dtype, batch: int, prompt_len: int
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The configuration's model in evaluation mode and ``dtype`` (seed 0), and a random prompt."""
    torch.manual_seed(0)
    model = build_model(arch, model_size, **overrides).eval().to(dtype)
    return model, torch.randint(0, model.config.vocab_size, (batch, prompt_len))


def count_prefill(arch: str, model_size: str, overrides: dict, batch: int, prompt_len: int, dtype) -> int:
    """Kernels of an eager prefill of ``batch`` prompts into a fresh cache (after one warm-up)."""
    model, prompt = _model_and_prompt(arch, model_size, overrides, dtype, batch, prompt_len)
    with torch.no_grad():
        model(prompt, cache=ModelCache(capacity=prompt_len + 4))  # lazily built state
        with KernelCount() as prefill:
            model(prompt, cache=ModelCache(capacity=prompt_len + 4))
    return sum(prefill.kernels.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gpt,hydra", help="race configurations, comma-separated")
    ap.add_argument("--model_size", default="100M")
    ap.add_argument("--take", type=float, default=0.125, help="share of tokens a routed block takes")
    ap.add_argument("--prompt_len", type=int, default=8, help="prompt tokens the prefill runs")
    ap.add_argument("--prefill_batch", type=int, default=1, help="also count the prefill at this batch")
    ap.add_argument("--set", action="append", default=[], help="as hydra-diag race's (e.g. *.dim=192)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--decode_conv", default=None, help="CCGQA's decode convs (hydra_model.options)")
    ap.add_argument(
        "--fused_decide",
        default="on",
        choices=["on", "off"],
        help="a routed block's decision as one kernel, as a GPU runs it (hydra_model.fused_decide); "
        "off: op by op",
    )
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    from hydra_diag.race.configs import parse_config_names, parse_sets, resolve_configs

    hydra_kernels.set_use_triton_kernels(True)  # what runs on a GPU, interpreted here
    if args.decode_conv is not None:
        from hydra_model.options import DECODE_CONVS, OPTIONS

        if args.decode_conv not in DECODE_CONVS:
            ap.error(f"--decode_conv {args.decode_conv!r}: expected one of {', '.join(DECODE_CONVS)}")
        OPTIONS.decode_conv = args.decode_conv
    sets = parse_sets(args.set)
    cfgs = resolve_configs(parse_config_names(args.configs), sets, lr=1.0, compile_default="none")
    rows, dtype = [], getattr(torch, args.dtype)
    for cfg in cfgs:
        row = {
            "config": cfg.name,
            **count_decode_step(
                cfg.arch, args.model_size, cfg.overrides, args.prompt_len, dtype, args.fused_decide
            ),
        }
        row["expected_per_step"] = row["plain"] + args.take * sum(row["routed_blocks"])
        if args.prefill_batch > 1:
            row[f"prefill_b{args.prefill_batch}"] = count_prefill(
                cfg.arch, args.model_size, cfg.overrides, args.prefill_batch, args.prompt_len, dtype
            )
        rows.append(row)
    print(f"{'config':<16} {'prefill':>7} {'plain':>6} {'routed blocks':>14} {'all run':>8} {'expected':>9}")
    for r in rows:
        routed = f"{len(r['routed_blocks'])} x {r['routed_blocks'][0]}" if r["routed_blocks"] else "-"
        print(
            f"{r['config']:<16} {r['prefill']:>7} {r['plain']:>6} {routed:>14} {r['all_blocks_run']:>8} "
            f"{r['expected_per_step']:>9.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"model_size": args.model_size, "dtype": args.dtype, "decode_conv": args.decode_conv}
                | {"fused_decide": args.fused_decide}
                | {"take": args.take, "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
