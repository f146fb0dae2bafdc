"""A decode step described as stages (what a model's ``decode_stages`` returns), how stages group
into segments, the report of how a generation decoded, and the decode modes: the vocabulary of
decode_graphs.py, which captures and replays them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DECODE_MODES = ("auto", "eager", "staged", "graphs", "masked")


@dataclass
class DecodeStage:
    """One piece of a decode step. ``run`` reads and writes only persistent buffers and the cache.
    ``flag`` (a 0-d bool tensor that ``run`` sets): the next stage is gated on it. ``gated``: run
    only when the previous stage's flag is set."""

    run: Callable[[], None]
    flag: torch.Tensor | None = None
    gated: bool = False


@dataclass
class DecodeReport:
    """How a generation decoded (``model.last_decode_report``)."""

    mode: str  # eager, staged, graphs or masked: what ran (none: max_new_tokens=0, no prefill either)
    requested: str  # what was asked for (auto resolved)
    reason: str | None = None  # why ``mode`` differs from ``requested``, or graphs are per segment
    segments: int = 0  # graphs (or eager segments) per step
    gated_segments: int = 0  # segments a routing decision can skip
    steps: int = 0  # decode steps run
    gated_run: int = 0  # gated segments run (masked: whose update was kept), over all steps
    gated_skipped: int = 0  # gated segments skipped (masked: run, update dropped), over all steps
    capture_ms: float = 0.0  # warm-up step and capture
    capture: str | None = None  # graphs: "one graph" (with conditional nodes where gated) or "per segment"
    #: the decoder (graphs, cache) of an earlier generation, replayed: no warm-up or capture
    reused: bool = False
    #: why a decoder held from an earlier generation was not reused (None: reused, or none held)
    not_reused: str | None = None
    #: how the prompt was prefilled: eager, or (a reused decoder on CUDA, a prompt length seen
    #: before) "graph captured" / "graph" (decoder_hold.py); "none" when max_new_tokens=0
    prefill: str = "eager"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class _Segment:
    stages: list[DecodeStage]
    gated: bool
    flag: torch.Tensor | None
    graph: torch.cuda.CUDAGraph | None = None

    def run(self) -> None:
        """Replay its graph, or run its stages where it has none."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run_stages()

    def run_stages(self) -> None:
        """Its stages, eagerly (or into the graph being captured)."""
        for stage in self.stages:
            stage.run()


def segments_of(stages: list[DecodeStage]) -> list[_Segment]:
    """Group stages: plain stages up to and including a decide stage form one segment, each gated
    stage one of its own."""
    out: list[_Segment] = []
    current: list[DecodeStage] = []
    for stage in stages:
        if stage.gated:
            if current:
                raise ValueError("a gated decode stage must follow a stage that sets a flag")
            if not out or out[-1].flag is None:
                raise ValueError("a gated decode stage must follow a stage that sets a flag")
            out.append(_Segment([stage], True, None))
            continue
        current.append(stage)
        if stage.flag is not None:
            out.append(_Segment(current, False, stage.flag))
            current = []
    if current:
        out.append(_Segment(current, False, None))
    return out


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in DECODE_MODES:
        raise ValueError(f"decode={mode!r}: expected one of {', '.join(DECODE_MODES)}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    if mode == "graphs" and device.type != "cuda":  # masked runs eagerly off CUDA
        raise ValueError(f"decode='graphs' needs a CUDA device; the model is on {device}")
    return mode
