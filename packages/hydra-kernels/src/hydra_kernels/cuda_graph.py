"""Capture a fixed-shape step once as a CUDA graph and replay it: HYDRA's capture of whole steps.

hydra-train's graphed training step (``hydra_train.graphed_step``), hydra-model's benchmarks
(``hydra_model.CUDAGraphStep`` is this class) and the kernel benchmarks' GPU-time measurement
(:func:`hydra_kernels.bench_harness.graph_ms`) all capture through :class:`CUDAGraphStep`.
Decoding is the exception (``hydra_model.decode_graphs``): its step is several graphs sharing one
memory pool, or one graph with conditional nodes, over buffers the model's stages own, which a
function-of-inputs capture like this one does not express.

A training step with fixed shapes and no host synchronisation spends much of its eager time on
the host launching small kernels. Recording the step once and replaying it removes that cost::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=True)

    def train_step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens[:, :-1], targets=tokens[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    step = CUDAGraphStep(train_step, first_batch)   # runs `warmup` real steps, then captures
    for batch in loader:
        loss = step(batch)                          # copy batch in, replay; loss is a graph output

Requirements (the capture fails loudly otherwise, nothing falls back silently): CUDA tensors of
the shapes given at capture; no host syncs inside ``fn`` (``.item()``, ``nonzero``, printing a
tensor); an optimizer built with ``capturable=True``; the learning rate changed only through
tensors the graph reads (or not at all). Outputs are the graph's own buffers, overwritten by the
next replay: clone what you keep.

Warm-up calls and the capture run on one side stream, so that per-stream lazy state (cuBLAS
workspaces, autotuning, compilation) exists before the capture. :meth:`CUDAGraphStep.deferred`
sets the step up without running anything, for callers that interleave the warm-up with their
own work (hydra-train's trainer runs one real training step as the warm-up call and captures
right after it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def end_generator_capture(device: torch.device | int | None = None) -> None:
    """Take ``device``'s default CUDA generator (the current device's by default) out of capture
    mode after a capture that raised. torch puts the generator in that mode when a capture begins
    and takes it out when the capture ends cleanly; a capture that failed (a host sync inside it,
    an out-of-memory, an op that cannot be captured) leaves it there, and every later random op
    on the device (dropout, sampling) then fails. A one-kernel capture on a side stream begins and
    ends cleanly, which resets it; the random stream goes on from where it was before the failed
    capture. Does nothing while the current stream is capturing: another capture is open (torch
    allows one at a time), and a capture here would break it."""
    if torch.cuda.is_current_stream_capturing():
        return
    with torch.cuda.device(device):
        scratch = torch.zeros(1, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        repair = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            repair.capture_begin()
            try:
                scratch.add_(1)  # one node, or torch warns that the graph is empty
            finally:  # even for an arm's time limit (a signal): no capture left open
                repair.capture_end()
        repair.reset()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """A side stream on the current device for captures there, one per device for the process.
    ``torch.cuda.graph``'s own default is one stream for the whole process, made on whichever
    device was current at the first capture, so a later capture for another device ran on the
    wrong device's stream: on two H200s a model on cuda:1 decoded with a graph per segment instead
    of one graph, and its decoder could not be kept (packages/hydra-model/BENCHMARKS.md, "Graphed
    decoding on a second GPU")."""
    index = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, **kwargs)`` that leaves the thread as it found it when the capture
    raises: torch's exit skips restoring the caller's stream (and device) when ending the capture
    fails, so the caller's eager fallback would run on the capture stream; and the CUDA generator
    is taken out of capture mode (:func:`end_generator_capture`) before the error propagates.
    Without a ``stream`` it captures on the current device's :func:`capture_stream`."""
    kwargs.setdefault("stream", capture_stream())
    capture = torch.cuda.graph(graph, **kwargs)
    device = capture.capture_stream.device
    caller_device = torch.cuda.current_device()
    # the capture device's stream first: set_stream also makes its device current
    caller_streams = [torch.cuda.current_stream(device), torch.cuda.current_stream(caller_device)]
    try:
        with capture:
            yield
    except BaseException:
        for stream in caller_streams:
            torch.cuda.set_stream(stream)
        torch.cuda.set_device(caller_device)
        with contextlib.suppress(Exception):  # the capture's error is the one to report
            end_generator_capture(device)
        raise


class CUDAGraphStep:
    """Capture ``fn(*inputs)`` once as a CUDA graph; each call copies new inputs into the
    captured input buffers and replays it. ``warmup`` untimed real calls run first on the side
    stream (lazy initialisation, autotuning and kernel compilation must not happen during
    capture); they are real steps: an optimizer inside ``fn`` updates the weights each time."""

    def __init__(self, fn: Callable[..., Any], *example_inputs: torch.Tensor, warmup: int = 3) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager call must run before the capture")
        self._setup(fn, example_inputs, None)
        self.warm_up(warmup)
        self.capture()

    @classmethod
    def deferred(
        cls, fn: Callable[..., Any], *example_inputs: torch.Tensor, stream: torch.cuda.Stream | None = None
    ) -> CUDAGraphStep:
        """Set up without running ``fn``: the caller calls :meth:`warm_up` (at least once) and then
        :meth:`capture`."""
        step = cls.__new__(cls)
        step._setup(fn, example_inputs, stream)
        return step

    def _setup(self, fn: Callable[..., Any], example_inputs: tuple, stream: torch.cuda.Stream | None) -> None:
        if any(not isinstance(t, torch.Tensor) or not t.is_cuda for t in example_inputs):
            raise ValueError("CUDAGraphStep: every input must be a CUDA tensor")
        self.fn = fn
        self.static_inputs = [t.detach().clone() for t in example_inputs]
        self.stream = stream if stream is not None else torch.cuda.Stream()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_outputs: Any = None
        self.warmed = 0
        self.replays = 0

    def load(self, *inputs: torch.Tensor) -> None:
        """Copy ``inputs`` into the captured input buffers (same count, shapes and dtypes)."""
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(
                    f"input {tuple(src.shape)} {src.dtype} differs from the captured "
                    f"{tuple(dst.shape)} {dst.dtype}: a CUDA graph replays fixed shapes; capture another"
                )
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)

    def warm_up(self, calls: int = 1) -> Any:
        """Run ``fn`` on the input buffers ``calls`` times on the side stream; returns the last
        call's output."""
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        out = None
        with torch.cuda.stream(side):
            for _ in range(calls):
                out = self.fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.warmed += calls
        return out

    def capture(self) -> None:
        """Record ``fn`` on the input buffers (nothing runs); later calls replay the recording."""
        if self.warmed < 1:
            raise ValueError("at least one warm-up call must run before the capture")
        torch.cuda.synchronize()
        # the warm-up's activations sit in the ordinary allocator's cache; the graph takes its
        # own pool, so hand them back first rather than hold both
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, stream=self.stream):
            outputs = self.fn(*self.static_inputs)
        self.graph, self.static_outputs = graph, outputs

    def replay(self) -> Any:
        """Replay the captured graph on what the input buffers hold; returns its output buffers."""
        if self.graph is None:
            raise ValueError("nothing captured yet: call capture() first")
        self.graph.replay()
        self.replays += 1
        return self.static_outputs

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self.load(*inputs)
        return self.replay()

    def release(self) -> None:
        """Drop the graph and its memory pool; the step cannot be replayed any more."""
        self.graph = None
        self.static_outputs = None
