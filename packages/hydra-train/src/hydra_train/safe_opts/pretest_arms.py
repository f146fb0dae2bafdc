"""Which arms a pretest runs (safe_opts/pretest.py runs them): the plan, apart from the running.

First phase: the safe default; one arm per applicable optimization; for ``cuda_graphs`` one per
routing mode asked for (static: a graph of the soft routing step, compared with a hidden eager
static-routing arm). Second phase, after the first phase's verdicts: the arm of each optimization
with ``pretest_on_top_of`` (torch.compile), with those of its bases that passed switched on —
the configuration the run will have, so that what the arm builds (compiled code) is what the
run reuses — compared with them (a hidden arm of them together when there are several), its
step-0 error bounded by theirs rather than by the safe default's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra_train.safe_opts.registry import Optimization

PASS, FAIL, NA = "PASS", "FAIL", "N/A"


@dataclass
class Arm:
    key: str
    opts: list[str]
    tested: str | None
    ref: str = "default"
    routing: str = "dynamic"
    hidden: bool = False  # a reference arm only, not a result
    #: take the step-0 probe although nothing here is tested: a stacked arm's bases together,
    #: whose error its own is bounded by
    probe: bool = False


def first_arms(reg: dict[str, Optimization], runnable: list[str], graph_modes: tuple[str, ...]) -> list[Arm]:
    """The first phase's arms, default first; empty when nothing is runnable."""
    if not runnable:
        return []
    arms = [Arm("default", [], None)]
    for name in runnable:
        if reg[name].pretest_on_top_of:
            continue  # its arm runs after the others' verdicts (stacked_arms)
        if name != "cuda_graphs":
            ran = next((a for a in arms if a.key == name), None)
            if ran is not None:  # static routing, already the static graph's hidden reference
                ran.tested, ran.hidden = name, False
                continue
            arms.append(Arm(name, [name], name, routing="static" if name == "static_routing" else "dynamic"))
            continue
        for mode in graph_modes:
            if mode == "dynamic":
                arms.append(Arm("cuda_graphs", ["cuda_graphs"], "cuda_graphs"))
                continue
            if not any(a.key == "static_routing" for a in arms):
                arms.append(Arm("static_routing", ["static_routing"], None, routing="static", hidden=True))
            arms.append(
                Arm(
                    "cuda_graphs[static]",
                    ["static_routing", "cuda_graphs"],
                    "cuda_graphs",
                    ref="static_routing",
                    routing="static",
                )
            )
    return arms


def stacked_arms(
    reg: dict[str, Optimization], runnable: list[str], results: dict[str, dict[str, Any]]
) -> list[Arm]:
    """The second phase's arms, from the first phase's ``results`` (the same on every rank)."""
    arms: list[Arm] = []
    for name in runnable:
        on_top = reg[name].pretest_on_top_of
        if not on_top:
            continue
        if any(reg[b].pretest_on_top_of for b in on_top):
            raise ValueError(f"{name}: a base of a stacked pretest ({on_top}) cannot be stacked itself")
        bases = [b for b in on_top if results.get(b, {}).get("status") == PASS]
        ref = "default"
        if len(bases) == 1:
            ref = bases[0]
        elif bases:
            ref = "+".join(bases)
            if not any(a.key == ref for a in arms):
                arms.append(Arm(ref, bases, None, hidden=True, probe=True))
        arms.append(Arm(name, [*bases, name], name, ref=ref))
    return arms
