"""Conditional (IF) nodes in CUDA graphs: work a captured graph runs only when a flag on the GPU is
set, decided by the GPU at replay time (CUDA 12.4+ driver; torch exposes it as
``CUDAGraph.begin_capture_to_if_node`` in releases after 2.11).

A decode step uses them to skip a routed block without the host reading the routing decision
(decode_graphs.py). Before the first use on a device, :func:`conditional_nodes_fail` captures a
small graph whose IF body allocates and computes, replays it with the flag set and cleared and
compares both results with eager ones: a torch or driver whose conditional nodes do not work is
reported and not used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_API = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")
_checked: dict[torch.device, str | None] = {}


def has_conditional_nodes() -> bool:
    """Whether this torch can capture conditional nodes into a CUDA graph (torch 2.11 cannot)."""
    return all(hasattr(torch.cuda.CUDAGraph, name) for name in _API)


@contextmanager
def if_node(flag: torch.Tensor) -> Iterator[None]:
    """Inside a ``torch.cuda.graph`` capture: what the block captures runs at replay only when
    ``flag`` (a 0-d bool CUDA tensor) is set."""
    capturing = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    capturing.begin_capture_to_if_node(flag)
    try:
        yield
    finally:
        capturing.end_capture_to_conditional_node()


def conditional_nodes_fail(device: torch.device) -> str | None:
    """None when conditional nodes work on ``device``, else why not (checked once per device)."""
    if device not in _checked:
        _checked[device] = _probe(device)
    return _checked[device]


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"conditional graph nodes need a CUDA device, not {device}"
    if not has_conditional_nodes():
        return f"torch {torch.__version__} has no conditional CUDA graph nodes"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(64, 64, device=device, generator=gen) / 8
        x = torch.randn(4, 64, device=device, generator=gen)
        state = torch.empty_like(x)
        flag = torch.zeros((), dtype=torch.bool, device=device)

        def body() -> None:  # allocates inside the IF body, as a block does
            state.copy_(torch.relu(state @ w) + state)

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            state.copy_(x)
            body()  # warm-up: kernels chosen and loaded before capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with if_node(flag):
                body()
            out = state * 2
        results = []
        for value in (True, False):
            state.copy_(x)
            flag.fill_(value)
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize(device)
        ran = torch.relu(x @ w) + x
        if not torch.allclose(results[0], 2 * ran, rtol=1e-4, atol=1e-4):
            return "a conditional node did not run its body with the flag set"
        if not torch.equal(results[1], 2 * x):
            return "a conditional node ran its body with the flag cleared"
    except Exception as err:  # a torch or driver without working conditional nodes
        return f"conditional node capture failed: {type(err).__name__}: {err}"
    return None
