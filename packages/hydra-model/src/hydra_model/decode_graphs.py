"""Decoding one token a step as CUDA graphs, with routed blocks skipped where their token is not taken.

At batch 1 a decode step is a few hundred small kernels: launching them from Python costs far
more than running them. Captured once as CUDA graphs and replayed, a step costs a few launches.
A Mixture-of-Depths block is skipped for a token its router does not take, so a model
describes its decode step as :class:`DecodeStage` s (``decode_stages``): plain stages, and for
each routed block a *decide* stage that writes the routing decision to a flag, followed by a
*gated* stage (the block) that runs only when the flag is set.

The whole step is captured as one graph in which each gated stage sits under a conditional (IF)
node on its flag: captured so by torch where it can (conditional_graphs.py), else each segment
captured on its own and one graph composed of them through the CUDA driver (graph_compose.py);
either is probed once per device before use. The GPU itself skips the block, a step is one replay
and the host never waits. With the 100M preset (MoD 12.5 % on five
blocks) most tokens skip the five routed blocks; the rest of HYDRA's step still launches more
kernels than the dense GPT's (packages/hydra-model/BENCHMARKS.md counts them). Where neither
way works, the step falls back (reported in
:class:`DecodeReport`) to a graph per segment: consecutive plain stages and the decide stage after
them form one graph, each gated stage another, and a step reads each flag on the host (one sync
per routed block) to skip or replay the block's graph. Measured on an H100, 100M preset, batch 1:
the per-segment graphs ran at a third of the GPT's tokens/s, the host waiting on each flag.

Every stage reads and writes persistent buffers (the token, the residual stream, the logits) and
the cache, which a decode step changes in place (cache.py), so a replay advances the same state
the capture saw. The first step runs the stages eagerly (gated stages unconditionally: a block
whose token is not taken leaves the stream and the cache unchanged): that warms up every kernel
(autotuning, Triton compilation, the attention backend's choice), so nothing is compiled during
capture; the per-generation constants (CCGQA's folded conv weights) are built by the prefill.
A decoder whose step already warmed up in this process (the same model class, tensor shapes,
routing rules, switches, mode, batch and cache capacity: ``decoder_hold.warm_signature``)
captures first and runs its first step as the graph's first replay, skipping the eager step; a
capture that made anything the step reads (a counter, a position: :meth:`ModelCache.snapshot`)
is rolled back and the step warms up as usual.

Modes (``generate(..., decode=...)``): ``eager`` (the model's forward, host reads skip routed
blocks), ``staged`` (the stages, run eagerly: the same arithmetic as ``graphs``, testable on a
CPU), ``graphs`` (CUDA only) and ``masked`` (every routed block runs, its update kept only where
its token was taken: no skipping and no host read, so on CUDA the step is one plain graph on any
torch; on a CPU the stages run eagerly). When no capture works (an op that reads the host, say),
decoding goes on eagerly with the stages and :class:`DecodeReport` says why. Which of ``graphs``
(per segment) and ``masked`` is faster where conditional nodes are missing is for a GPU to say:
``hydra-diag bench inference --decode graphs,masked`` times both.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from hydra_kernels.cuda_graph import graph_capture
from hydra_model.conditional_graphs import conditional_nodes_fail, if_node
from hydra_model.decode_stages import (  # re-exported: where the models and callers import them
    DECODE_MODES,
    DecodeReport,
    DecodeStage,
    _Segment,
    resolve_mode,
    segments_of,
)
from hydra_model.decoder_hold import Fingerprint, is_warm, mark_warm, warm_signature
from hydra_model.graph_compose import ComposedGraph, capture_graphs, driver_conditional_fail

__all__ = ["DECODE_MODES", "DecodeReport", "DecodeStage", "StagedDecoder", "resolve_mode", "segments_of"]


class StagedDecoder:
    """Decode steps of ``model`` (which has ``decode_stages``) on a filled ``cache``: ``step(tokens
    [B])`` → logits [B, V] (a buffer the next step overwrites)."""

    def __init__(self, model, cache, batch: int, device: torch.device, mode: str) -> None:
        weight = model.embed.weight
        self.cache = cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.logits = torch.empty(batch, model.config.vocab_size, dtype=weight.dtype, device=device)
        # the routed blocks' decision flags as slots of one vector (a block decides once at most)
        self._flags = torch.zeros(len(getattr(model, "blocks", ())), dtype=torch.bool, device=device)
        self.segments = segments_of(model.decode_stages(cache, self.tokens, self.logits, flags=self._flags))
        self.report = DecodeReport(
            mode=mode,
            requested=mode,
            segments=len(self.segments),
            gated_segments=sum(s.gated for s in self.segments),
        )
        self._ready = mode != "graphs" and not (mode == "masked" and device.type == "cuda")
        self._step_graph: torch.cuda.CUDAGraph | ComposedGraph | None = None  # the whole step, one graph
        # routing decisions of the steps that never read them on the host (the whole-step graph,
        # masked steps), summed on the device and read once by finish(): with every flag a slot of
        # one vector, one kernel a step adds the vector (a tally per slot), else one per flag
        flags = [seg.flag for seg in self.segments if seg.flag is not None]
        self._pooled = bool(flags) and all(f._base is self._flags for f in flags)
        shape = self._flags.shape if self._pooled else ()
        self._taken = torch.zeros(shape, dtype=torch.long, device=device)
        self._device_counted = 0
        # a step whose kernels all ran before in this process is captured with no warm-up step;
        # the model's structure taken once serves that signature and a kept decoder's fingerprint
        fp = self.fingerprint = None if self._ready else Fingerprint(model)
        self._signature = fp and warm_signature(model, mode, batch, cache.capacity, device, fp.structure)

    def reuse(self, requested: str, prefill: str) -> None:
        """Start another generation on the same graphs, the cache refilled in place by the new
        prompt's prefill (decoder_hold.py; ``prefill`` says how it ran): a fresh report, no
        warm-up, no capture."""
        old = self.report
        self.report = DecodeReport(
            mode=old.mode, requested=requested, reason=old.reason, segments=old.segments,
            gated_segments=old.gated_segments, capture=old.capture,
            reused=True, prefill=prefill, extra=dict(old.extra),
        )  # fmt: skip
        self._taken.zero_()
        self._device_counted = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.check_room(1)
        self.tokens.copy_(tokens.view(-1, 1))
        if not self._ready:
            self._warm_up_and_capture()  # and this step
        else:
            self._run_ready()
        self.report.steps += 1
        return self.logits

    def _run_ready(self) -> None:
        """One step on the captured graphs (or the stages, where capture failed)."""
        if self._step_graph is not None:
            self._step_graph.replay()
            self.cache.advance_host(1)  # the graph advanced the device position
            self._device_counted += 1
        elif self.report.mode == "masked":
            self._run_masked()
        else:
            self._run(graphs=self.report.mode == "graphs")

    def finish(self) -> DecodeReport:
        """The report with the routing decisions counted on the device (one host read, after the
        last step)."""
        if self._device_counted:
            ran = int(self._taken.sum())
            self.report.gated_run += ran
            self.report.gated_skipped += self._device_counted * self.report.gated_segments - ran
            self._taken.zero_()
            self._device_counted = 0
        return self.report

    def _run_masked(self) -> None:
        for seg in self.segments:
            seg.run()
            self._count(seg)
        self._count_step()
        self._device_counted += 1

    def _count(self, seg: _Segment) -> None:
        """Tally one segment's decision on the device (where the flags are not one vector)."""
        if seg.flag is not None and not self._pooled:
            self._taken.add_(seg.flag)

    def _count_step(self) -> None:
        """Tally every decision of the step at once, after the last (where they are one vector)."""
        if self._pooled:
            self._taken.add_(self._flags)

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
        """This step eagerly (the warm-up), then the capture. Where a decoder of the same
        signature warmed up before in this process (``decoder_hold.warm_signature``: its kernels
        compiled and tuned; the per-generation constants are built by the prefill), the capture
        comes first and this step is its first replay (:meth:`_capture_warm`)."""
        start = time.perf_counter()
        warm = self._signature is not None and is_warm(self._signature) and self._capture_warm()
        self.report.extra["warm_up_step"] = not warm
        if not warm:
            self._warm_up()
            self._capture()
            if self._step_graph is not None and self._signature is not None:
                mark_warm(self._signature)
        self.report.capture_ms = 1000.0 * (time.perf_counter() - start)

    def _warm_up(self) -> None:
        taken = 0
        for seg in self.segments:  # every stage once, eagerly: this step's real work (a gated
            seg.run_stages()  # stage runs whatever its flag: its update is masked)
            if seg.flag is not None:
                taken += bool(seg.flag)  # host reads, once per generation
        self.report.gated_run += taken
        self.report.gated_skipped += self.report.gated_segments - taken

    def _capture_warm(self) -> bool:
        """Capture the step before running it, then run it as the graph's first replay. A step
        that created what it reads while being captured (a counter, a conv weight: a warm-up
        would have made it) would replay that creation every step: such a capture, or one that
        fails, is dropped (False), and the step warms up and is captured as usual."""
        before, failed = self.cache.snapshot(), None
        try:
            graph = self._capture_step(conditional=self.report.mode == "graphs")
        except Exception as err:  # reported; the usual path below reports again if it fails too
            graph, failed = None, f"{type(err).__name__}: {err}"
        finally:
            torch.cuda.synchronize(self.tokens.device)
        made_state = not self.cache.same_references(before, self.cache.snapshot())
        self.cache.rollback(before)  # the host bookkeeping the capture recorded, and what it made
        if graph is None or made_state:
            why = failed or "the step made state it reads (a counter, a position, a conv weight)"
            self.report.extra["capture_first_dropped"] = why
            return False
        self._step_graph, self._ready = graph, True
        self.report.capture = "one graph"
        self._run_ready()
        return True

    def _capture(self) -> None:
        """The one-graph capture, else a graph per segment, else eager stages (each reported)."""
        self._ready = True
        seq_len = self.cache.seq_len  # capture records the stages' host bookkeeping: undo it
        try:
            try:
                self._step_graph = self._capture_step(conditional=self.report.mode == "graphs")
                self.report.capture = "one graph"
            except Exception as err:  # reported; a graph per segment instead
                if self.report.mode == "masked":  # nothing to fall back to but eager stages
                    raise
                self._step_graph = None
                self.cache.seq_len = seq_len
                self.report.reason = (
                    f"one-graph capture failed ({type(err).__name__}: {err}): a graph per segment, "
                    "the host reading each routed block's flag"
                )
                warnings.warn(f"decoding with a CUDA graph per segment: {self.report.reason}", stacklevel=3)
                self._capture_segments()
                self.report.capture = "per segment"
        except Exception as err:  # reported, and decoding goes on eagerly
            for seg in self.segments:
                seg.graph = None
            self.report.mode = "staged"
            self.report.capture = None
            self.report.reason = f"CUDA graph capture failed: {type(err).__name__}: {err}"
            warnings.warn(f"decoding without CUDA graphs: {self.report.reason}", stacklevel=3)
        finally:
            self.cache.seq_len = seq_len
            torch.cuda.synchronize(self.tokens.device)

    def _capture_step(self, conditional: bool) -> torch.cuda.CUDAGraph | ComposedGraph:
        """The whole step as one graph; each gated segment under an IF node on the flag the
        segment before it set, so that the GPU skips the block (``conditional``), or run always,
        its update masked (masked mode). No host read either way. IF nodes come from torch's
        capture where it has them, else from a graph composed through the driver
        (graph_compose.py); ``report.extra["conditional_nodes"]`` says which."""
        if conditional and self.report.gated_segments:
            device = self.tokens.device
            failed = conditional_nodes_fail(device)
            if failed is not None:
                composed_failed = driver_conditional_fail(device)
                if composed_failed is not None:
                    raise RuntimeError(f"{failed}; {composed_failed}")
                self.report.extra["conditional_nodes"] = "driver"
                with torch.cuda.device(device):  # the driver builds in the current context
                    return self._compose_step()
            self.report.extra["conditional_nodes"] = "torch"
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=torch.cuda.graph_pool_handle()):
                for run, gate in self._pieces():
                    if gate is None:
                        run()
                        continue
                    with if_node(gate):
                        run()
            return graph
        pieces = self._pieces()  # plain: every piece runs (masked mode, or nothing gated)

        def whole() -> None:
            for run, _ in pieces:
                run()

        # no allocator trim before it, as the composed step's captures (graph_compose.py)
        return capture_graphs([whole], torch.cuda.graph_pool_handle())[0]

    def _compose_step(self) -> ComposedGraph:
        """Each piece captured on its own (one pool, capture order), then one driver-built graph
        of them with each gated segment under an IF node on its decide stage's flag."""
        pieces = self._pieces()
        graphs = capture_graphs([run for run, _ in pieces], torch.cuda.graph_pool_handle(), keep_graph=True)
        return ComposedGraph([(graph, gate) for graph, (_, gate) in zip(graphs, pieces, strict=True)])

    def _pieces(self) -> list[tuple[Callable[[], None], torch.Tensor | None]]:
        """The step as (run, gate) in order: a gated segment's stages with the flag the segment
        before it set, a plain segment's (None) counting its decision on the device, if it makes
        one (read once by :meth:`finish`)."""
        pieces: list[tuple[Callable[[], None], torch.Tensor | None]] = []
        flag = None
        last_plain = max(i for i, seg in enumerate(self.segments) if not seg.gated)
        for i, seg in enumerate(self.segments):
            if seg.gated:
                pieces.append((seg.run_stages, flag))
                continue

            def run(seg: _Segment = seg, last: bool = i == last_plain) -> None:
                seg.run_stages()
                self._count(seg)
                if last:
                    self._count_step()

            pieces.append((run, None))
            flag = seg.flag if seg.flag is not None else flag
        return pieces

    def _capture_segments(self) -> None:
        graphs = capture_graphs([seg.run_stages for seg in self.segments], torch.cuda.graph_pool_handle())
        for seg, graph in zip(self.segments, graphs, strict=True):
            seg.graph = graph
