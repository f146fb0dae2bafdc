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

from hydra_kernels.cuda_graph import graph_capture

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


class ProbeCase:
    """What the probes of conditional nodes run (here and in graph_compose.py): an IF body that
    allocates and computes, as a block does, and a tail after it; :meth:`check` replays with the
    flag set and cleared and compares both with eager results."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.device = device
        self.w = torch.randn(64, 64, device=device, generator=gen) / 8
        self.x = torch.randn(4, 64, device=device, generator=gen)
        self.state, self.out = torch.empty_like(self.x), torch.empty_like(self.x)
        self.flag = torch.zeros((), dtype=torch.bool, device=device)

    def body(self) -> None:
        self.state.copy_(torch.relu(self.state @ self.w) + self.state)

    def tail(self) -> None:
        self.out.copy_(self.state * 2)

    def warm_up(self) -> None:
        """Kernels chosen and loaded before any capture."""
        self.state.copy_(self.x)
        self.body()
        self.tail()

    def check(self, replay, what: str) -> str | None:
        """None when ``replay()`` ran the body with the flag set and only then, else what failed."""
        results = []
        for value in (True, False):
            self.state.copy_(self.x)
            self.flag.fill_(value)
            replay()
            results.append(self.out.clone())
        torch.cuda.synchronize(self.device)
        ran = torch.relu(self.x @ self.w) + self.x
        if not torch.allclose(results[0], 2 * ran, rtol=1e-4, atol=1e-4):
            return f"{what} did not run its body with the flag set"
        if not torch.equal(results[1], 2 * self.x):
            return f"{what} ran its body with the flag cleared"
        return None


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"conditional graph nodes need a CUDA device, not {device}"
    if not has_conditional_nodes():
        return f"torch {torch.__version__} has no conditional CUDA graph nodes"
    try:
        case = ProbeCase(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            case.warm_up()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), graph_capture(graph):  # captured on the device's stream
            with if_node(case.flag):
                case.body()
            case.tail()
        return case.check(graph.replay, "a conditional node")
    except Exception as err:  # a torch or driver without working conditional nodes
        return f"conditional node capture failed: {type(err).__name__}: {err}"
