"""Decoding one token a step as CUDA graphs, with the routed blocks skipped on the host's word.

At batch 1 a decode step is a few hundred small kernels: launching them from Python costs far
more than running them. Captured once as CUDA graphs and replayed, a step costs a few launches.
A whole step cannot be one graph for HYDRA: a Mixture-of-Depths block is skipped for a token its
router does not take, and torch's CUDA graphs (2.11) have no conditional nodes. So a model
describes its decode step as :class:`DecodeStage` s (``decode_stages``): plain stages, and for
each routed block a *decide* stage that writes the routing decision to a flag, followed by a
*gated* stage (the block) that runs only when the flag is set. Consecutive plain stages and the
decide stage after them are captured as one graph; each gated stage is a graph of its own. A step
replays the graphs in order and reads each flag on the host (one sync per routed block) to skip
or replay the block's graph. With the 100M preset (MoD 12.5 % on five blocks) most tokens skip
the five routed blocks: fewer kernels than the dense GPT's single graph.

Every stage reads and writes persistent buffers (the token, the residual stream, the logits) and
the cache, which a decode step changes in place (cache.py), so a replay advances the same state
the capture saw. The first step runs the stages eagerly (gated stages unconditionally: a block
whose token is not taken leaves the stream and the cache unchanged): that warms up every kernel
(autotuning, Triton compilation, the attention backend's choice) and builds the per-generation
constants (the folded conv weights), so nothing is allocated or compiled during capture.

Modes (``generate(..., decode=...)``): ``eager`` (the model's forward, host reads skip routed
blocks), ``staged`` (the stages, run eagerly: the same arithmetic as ``graphs``, testable on a
CPU) and ``graphs`` (CUDA only). When capture fails (an op that reads the host, say), decoding
goes on eagerly with the stages and :class:`DecodeReport` says why.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DECODE_MODES = ("auto", "eager", "staged", "graphs")


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

    mode: str  # eager, staged or graphs: what ran
    requested: str  # what was asked for (auto resolved)
    reason: str | None = None  # why ``mode`` differs from ``requested``
    segments: int = 0  # graphs (or eager segments) per step
    gated_segments: int = 0  # segments a routing decision can skip
    steps: int = 0  # decode steps run
    gated_run: int = 0  # gated segments run, over all steps
    gated_skipped: int = 0  # gated segments skipped, over all steps
    capture_ms: float = 0.0  # warm-up step and capture
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
        if self.graph is not None:
            self.graph.replay()
        else:
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
    if mode == "graphs" and device.type != "cuda":
        raise ValueError(f"decode='graphs' needs a CUDA device; the model is on {device}")
    return mode


class StagedDecoder:
    """Decode steps of ``model`` (which has ``decode_stages``) on a filled ``cache``: ``step(tokens
    [B])`` → logits [B, V] (a buffer the next step overwrites)."""

    def __init__(self, model, cache, batch: int, device: torch.device, mode: str) -> None:
        weight = model.embed.weight
        self.cache = cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.logits = torch.empty(batch, model.config.vocab_size, dtype=weight.dtype, device=device)
        self.segments = segments_of(model.decode_stages(cache, self.tokens, self.logits))
        self.report = DecodeReport(
            mode=mode,
            requested=mode,
            segments=len(self.segments),
            gated_segments=sum(s.gated for s in self.segments),
        )
        self._ready = mode != "graphs"

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        if not self._ready:
            self._warm_up_and_capture()
        else:
            self._run(graphs=self.report.mode == "graphs")
        self.report.steps += 1
        return self.logits

    def _run(self, graphs: bool) -> None:
        take_next = True
        for seg in self.segments:
            if seg.gated and not take_next:
                self.report.gated_skipped += 1
                take_next = True
                continue
            seg.run()
            if seg.gated:
                self.report.gated_run += 1
            # one host read per routed block: the only sync of a graphed step
            take_next = bool(seg.flag) if seg.flag is not None else True
        if graphs:
            self.cache.advance_host(1)  # the graph advanced the device position

    def _warm_up_and_capture(self) -> None:
        start = time.perf_counter()
        for seg in self.segments:  # every stage once, eagerly: this step's real work
            for stage in seg.stages:
                stage.run()
        self.report.gated_run += self.report.gated_segments
        self._ready = True
        seq_len = self.cache.seq_len  # capture records the stages' host bookkeeping: undo it
        try:
            pool = torch.cuda.graph_pool_handle()
            for seg in self.segments:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    for stage in seg.stages:
                        stage.run()
                seg.graph = graph
        except Exception as err:  # reported, and decoding goes on eagerly
            for seg in self.segments:
                seg.graph = None
            self.report.mode = "staged"
            self.report.reason = f"CUDA graph capture failed: {type(err).__name__}: {err}"
            warnings.warn(f"decoding without CUDA graphs: {self.report.reason}", stacklevel=3)
        finally:
            self.cache.seq_len = seq_len
            torch.cuda.synchronize(self.tokens.device)
        self.report.capture_ms = 1000.0 * (time.perf_counter() - start)
