"""One CUDA graph assembled from captured pieces, with IF nodes, through the CUDA driver: conditional
graph nodes for a torch that cannot capture them (torch 2.11 has no ``begin_capture_to_if_node``).

A decode step's segments (decode_graphs.py) are captured as ordinary torch graphs, one after the
other in one memory pool and kept un-instantiated (``CUDAGraph(keep_graph=True)``). This module
builds a parent graph from them with the driver API (ctypes on ``libcuda``; no extra package):

    plain segment   →  a child-graph node (a copy of the captured graph)
    gated segment   →  a one-thread kernel node that copies the decide stage's flag (a bool on
                       the GPU) into a conditional handle, then an IF node on that handle whose
                       body is a child-graph node of the segment

chained in capture order. One launch replays the step and the GPU itself skips a routed block
whose token was not taken; the host never reads a flag. The pieces replay in the order they were
captured, with the addresses they were captured with, exactly as the per-segment graphs do; a
skipped piece is one the per-segment path would not have replayed either.

The flag-to-handle kernel is a few lines of PTX written here: ``cudaGraphSetConditional`` is a
device function the driver resolves when it loads the module. Driver entry points are fetched by
their exported names (each keeps the ABI it was introduced with), so a newer driver gives the
signatures declared below.

:func:`driver_conditional_fail` checks the whole path once per device (compose, replay with the
flag set and cleared, compare with eager results) before a decoder relies on it.
"""

from __future__ import annotations

import contextlib
import ctypes
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p

import torch

from hydra_kernels.cuda_graph import capture_stream, end_generator_capture
from hydra_model.conditional_graphs import ProbeCase

_NODE_KERNEL, _NODE_CONDITIONAL = 0, 13  # CUgraphNodeType
_COND_IF = 0  # CUgraphConditionalNodeType

# Sets a conditional handle to 1 when the byte at ``flag`` is non-zero, else 0 (one thread).
_SET_IF_PTX = rb"""
.version 7.8
.target sm_70
.address_size 64

.extern .func cudaGraphSetConditional
(
    .param .b64 handle,
    .param .b32 value
);

.visible .entry hydra_set_if_from_flag(
    .param .u64 handle_in,
    .param .u64 flag_in
)
{
    .reg .pred %p1;
    .reg .b16 %rs1;
    .reg .b32 %r1;
    .reg .b64 %rd<4>;

    ld.param.u64 %rd1, [handle_in];
    ld.param.u64 %rd2, [flag_in];
    cvta.to.global.u64 %rd3, %rd2;
    ld.global.u8 %rs1, [%rd3];
    setp.ne.s16 %p1, %rs1, 0;
    selp.u32 %r1, 1, 0, %p1;
    {
        .param .b64 arg_handle;
        st.param.b64 [arg_handle+0], %rd1;
        .param .b32 arg_value;
        st.param.b32 [arg_value+0], %r1;
        call.uni cudaGraphSetConditional, (arg_handle, arg_value);
    }
    ret;
}
"""


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v3."""

    _fields_ = [
        ("func", c_void_p),
        ("gridDimX", c_uint),
        ("gridDimY", c_uint),
        ("gridDimZ", c_uint),
        ("blockDimX", c_uint),
        ("blockDimY", c_uint),
        ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint),
        ("kernelParams", c_void_p),
        ("extra", c_void_p),
        ("kern", c_void_p),
        ("ctx", c_void_p),
    ]


class ConditionalNodeParams(ctypes.Structure):
    """CUDA_CONDITIONAL_NODE_PARAMS (``phGraph_out`` is written by the driver: the body graphs)."""

    _fields_ = [
        ("handle", c_uint64),
        ("type", c_int),
        ("size", c_uint),
        ("phGraph_out", POINTER(c_void_p)),
        ("ctx", c_void_p),
    ]


class _NodeUnion(ctypes.Union):
    _fields_ = [
        ("reserved1", ctypes.c_longlong * 29),
        ("kernel", KernelNodeParams),
        ("conditional", ConditionalNodeParams),
    ]


class GraphNodeParams(ctypes.Structure):
    """CUgraphNodeParams: a node type, then its parameters in a 232-byte union (256 bytes in all)."""

    _anonymous_ = ("u",)
    _fields_ = [
        ("type", c_int),
        ("reserved0", c_int * 3),
        ("u", _NodeUnion),
        ("reserved2", ctypes.c_longlong),
    ]


_SIGNATURES = {
    "cuGetErrorString": (c_int, POINTER(c_char_p)),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuModuleLoadData": (POINTER(c_void_p), c_char_p),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuGraphCreate": (POINTER(c_void_p), c_uint),
    "cuGraphDestroy": (c_void_p,),
    "cuGraphAddChildGraphNode": (POINTER(c_void_p), c_void_p, POINTER(c_void_p), c_size_t, c_void_p),
    "cuGraphConditionalHandleCreate": (POINTER(c_uint64), c_void_p, c_void_p, c_uint, c_uint),
    "cuGraphInstantiateWithFlags": (POINTER(c_void_p), c_void_p, c_ulonglong),
    "cuGraphLaunch": (c_void_p, c_void_p),
    "cuGraphExecDestroy": (c_void_p,),
}


class CudaDriverError(RuntimeError):
    """A driver call failed (its name and the driver's message)."""


class _Driver:
    """The few driver entry points this module needs, typed. Each is looked up by its exported
    name, which keeps the ABI it was introduced with; ``cuGraphAddNode`` is taken in its edge-data
    form (``_v2``, CUDA 12.3+) where the driver exports it, since CUDA 13 headers give that form
    the plain name."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = c_int, argtypes
            setattr(self, name, fn)
        edge = getattr(lib, "cuGraphAddNode_v2", None)
        if edge is not None:  # (node out, graph, deps, edge data (NULL: default edges), n, params)
            edge.restype = c_int
            edge.argtypes = (POINTER(c_void_p), c_void_p, POINTER(c_void_p), c_void_p, c_size_t)
            edge.argtypes += (POINTER(GraphNodeParams),)
            self._add = lambda node, graph, deps, n, params: edge(node, graph, deps, None, n, params)
        else:
            plain = lib.cuGraphAddNode
            plain.restype = c_int
            plain.argtypes = (POINTER(c_void_p), c_void_p, POINTER(c_void_p), c_size_t)
            plain.argtypes += (POINTER(GraphNodeParams),)
            self._add = plain
        self._set_if: dict[int, c_void_p] = {}  # the flag-to-handle kernel, per CUDA context

    def set_if_kernel(self, ctx: c_void_p) -> c_void_p:
        """The flag-to-handle kernel in ``ctx`` (a module belongs to the context it was loaded in:
        each device's context loads its own)."""
        if ctx.value not in self._set_if:
            module, func = c_void_p(), c_void_p()
            self.call("cuModuleLoadData", byref(module), _SET_IF_PTX)
            self.call("cuModuleGetFunction", byref(func), module, b"hydra_set_if_from_flag")
            self._set_if[ctx.value] = func
        return self._set_if[ctx.value]

    def add_node(self, what: str, node, graph, deps, n: int, params: GraphNodeParams) -> None:
        """cuGraphAddNode; ``what`` names the node in an error."""
        res = self._add(node, graph, deps, n, params)
        if res != 0:
            raise CudaDriverError(f"cuGraphAddNode ({what}) failed: {self.error_text(res)} ({res})")

    def error_text(self, res: int) -> str:
        msg = c_char_p()
        self.cuGetErrorString(res, byref(msg))
        return msg.value.decode() if msg.value else "unknown error"

    def call(self, name: str, *args) -> None:
        res = getattr(self, name)(*args)
        if res != 0:
            raise CudaDriverError(f"{name} failed: {self.error_text(res)} ({res})")


_driver: _Driver | None = None


def driver() -> _Driver:
    """The process's driver bindings (loaded on first use; needs CUDA initialised, as torch does)."""
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def add_if_node(
    graph: c_void_p, after: c_void_p | None, handle: c_uint64, ctx: c_void_p
) -> tuple[c_void_p, c_void_p]:
    """An IF node on ``handle`` in ``graph``, after node ``after`` (None: a root) → (the node, its
    body graph, empty: the caller adds what it runs)."""
    params = GraphNodeParams()
    params.type = _NODE_CONDITIONAL
    params.conditional.handle = handle.value
    params.conditional.type = _COND_IF
    params.conditional.size = 1
    params.conditional.ctx = ctx
    node = c_void_p()
    deps, n = (byref(after), 1) if after is not None else (None, 0)
    driver().add_node("conditional IF", byref(node), graph, deps, n, byref(params))
    return node, c_void_p(params.conditional.phGraph_out[0])


class ComposedGraph:
    """A parent graph of captured torch graphs (``keep_graph=True``), each piece either run
    always or under an IF node on a bool flag: ``pieces`` is [(graph, flag or None)] in order."""

    def __init__(self, pieces: list[tuple[torch.cuda.CUDAGraph, torch.Tensor | None]]) -> None:
        """Built in the current CUDA context: the caller makes its device current."""
        self._graph, self._exec = c_void_p(), c_void_p()  # what __del__ destroys, once made
        drv = driver()
        self._drv = drv
        self._pieces = pieces  # keeps the captured graphs, their memory pool and the flags alive
        ctx = c_void_p()
        drv.call("cuCtxGetCurrent", byref(ctx))
        self._set_if_kernel = drv.set_if_kernel(ctx)
        self._device = torch.cuda.current_device()
        parent = self._graph
        drv.call("cuGraphCreate", byref(parent), 0)
        prev: c_void_p | None = None
        for graph, flag in pieces:
            raw = c_void_p(graph.raw_cuda_graph())
            if flag is None:
                prev = self._child(parent, prev, raw)
                continue
            if flag.dtype != torch.bool or flag.numel() != 1 or not flag.is_cuda:
                raise ValueError(f"a gate flag is one bool on the GPU, not {flag.dtype} {list(flag.shape)}")
            handle = c_uint64()
            drv.call("cuGraphConditionalHandleCreate", byref(handle), parent, ctx, 0, 0)
            setter = self._set_if(parent, prev, handle, flag.data_ptr())
            node, body = add_if_node(parent, setter, handle, ctx)
            self._child(body, None, raw)
            prev = node
        drv.call("cuGraphInstantiateWithFlags", byref(self._exec), parent, 0)

    def _child(self, graph: c_void_p, prev: c_void_p | None, raw: c_void_p) -> c_void_p:
        node = c_void_p()
        deps, n = (byref(prev), 1) if prev is not None else (None, 0)
        self._drv.call("cuGraphAddChildGraphNode", byref(node), graph, deps, n, raw)
        return node

    def _set_if(self, graph: c_void_p, prev: c_void_p | None, handle: c_uint64, flag_ptr: int) -> c_void_p:
        args = (c_uint64(handle.value), c_uint64(flag_ptr))
        arg_ptrs = (c_void_p * 2)(*(ctypes.addressof(a) for a in args))
        params = GraphNodeParams()
        params.type = _NODE_KERNEL
        k = params.kernel
        k.func = self._set_if_kernel
        k.gridDimX = k.gridDimY = k.gridDimZ = 1
        k.blockDimX = k.blockDimY = k.blockDimZ = 1
        k.kernelParams = ctypes.cast(arg_ptrs, c_void_p)
        node = c_void_p()
        deps, n = (byref(prev), 1) if prev is not None else (None, 0)
        self._drv.add_node("flag-to-handle kernel", byref(node), graph, deps, n, byref(params))
        return node

    def replay(self) -> None:
        """Launch the whole graph on its device's current stream. A plain graph launch: unlike
        ``CUDAGraph.replay`` it does not advance torch's CUDA random offsets, so the pieces must
        draw no random numbers on the GPU (a decode step's stages draw none)."""
        stream = torch.cuda.current_stream(self._device).cuda_stream
        self._drv.call("cuGraphLaunch", self._exec, c_void_p(stream))

    def __del__(self) -> None:
        drv = getattr(self, "_drv", None)
        if drv is None:
            return
        if self._exec.value:
            drv.cuGraphExecDestroy(self._exec)
        if self._graph.value:
            drv.cuGraphDestroy(self._graph)


def capture_graphs(fns: list, pool, keep_graph: bool = False) -> list[torch.cuda.CUDAGraph]:
    """Each of ``fns`` captured into a graph of its own (instantiated, or kept un-instantiated
    with ``keep_graph``, for :class:`ComposedGraph`), one after the other in one memory pool, on
    the current device's capture stream (hydra_kernels' ``capture_stream``). ``torch.cuda.graph``
    synchronizes the device and trims the allocator's cache before every capture; here the device
    is synchronized once for all of them (a decode step is eleven pieces at HYDRA's 100M preset,
    packages/hydra-model/BENCHMARKS.md). The cache is not trimmed: the graphs allocate from their
    own pool either way, and a trim gave its blocks back to the driver only for the next prefill
    to ask for them again (seven frees, then as many allocations: about a millisecond of host time
    in a batch-1 generate call on an H100)."""
    torch.cuda.synchronize()
    graphs = []
    with torch.cuda.stream(capture_stream()):  # the current device's (cuda_graph.py)
        for fn in fns:
            graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
            graph.capture_begin(pool)
            try:
                try:
                    fn()
                except BaseException:
                    # end the capture so that the stream is usable again; the error to report is fn's
                    with contextlib.suppress(Exception):
                        graph.capture_end()
                    raise
                graph.capture_end()  # fails where the capture was invalidated without fn raising
            except BaseException:
                # a failed capture leaves torch's CUDA generator in capture mode (cuda_graph.py)
                with contextlib.suppress(Exception):
                    end_generator_capture()
                raise
            graphs.append(graph)
    return graphs


_checked: dict[torch.device, str | None] = {}


def driver_conditional_fail(device: torch.device) -> str | None:
    """None when composed graphs with IF nodes work on ``device``, else why not (checked once)."""
    if device not in _checked:
        _checked[device] = _probe(device)
    return _checked[device]


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"conditional graph nodes need a CUDA device, not {device}"
    try:
        with torch.cuda.device(device):
            case = ProbeCase(device)
            case.warm_up()
            torch.cuda.synchronize(device)
            pool = torch.cuda.graph_pool_handle()
            body, tail = capture_graphs([case.body, case.tail], pool, keep_graph=True)
            pieces = [(body, case.flag), (tail, None)]
            composed = ComposedGraph(pieces)
            return case.check(composed.replay, "a composed IF node")
    except Exception as err:  # a driver or torch without what this needs
        return f"composed conditional graph failed: {type(err).__name__}: {err}"
