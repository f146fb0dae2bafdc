"""A model's last decoder, kept for its next ``generate``: the warm-up and capture paid once, and on
CUDA the prompt's prefill replayed as a graph too.

Building a graphed decoder costs a warm-up step and the capture of its graphs (21–45 ms for
HYDRA's 100M preset on an H100, more than 50 of its decode steps: see
packages/hydra-model/BENCHMARKS.md), and an eager prefill costs a host launch per kernel (about a
thousand for HYDRA's routed forward). A caller that generates again with the same batch size and
a total length in the same bucket (a benchmark, an evaluation loop, prompts of different lengths)
gets the same decoder back. A kept decoder's cache holds the prompt and the new tokens rounded up
to a multiple of ``CAPACITY_STEP`` positions (:func:`cache_capacity`; a step's attention gives
the positions past the generation's end, masked, zero weight). A new generation empties the cache
and refills it in place with its prompt's prefill (:meth:`ModelCache.restart`), so the captured
graphs, which read those tensors, replay the new generation. A prompt length seen before is
prefilled by a graph captured the second time it comes (the first run warmed its kernels up).

A decoder is handed back only when nothing it captured can have changed:

* the request: decode mode, batch size, cache capacity (prompt + new tokens, rounded up),
  device and dtype;
* the process-wide switches a step's kernels depend on (hydra_model's and hydra_kernels' options,
  the fused decision's mode) and every module's routing rule and static flag;
* the parameters and buffers (all but the ``stat_*`` statistics, which every forward writes and
  no decode step reads), by storage, shape and content: a checksum of each tensor's raw bits,
  each word weighted by its position (``hydra_kernels.ops.checksum``: a changed element or two
  swapped ones change it). Content, not ``Tensor._version``: a replayed CUDA graph (hydra-train's
  training step) or an update through ``.data`` changes weights without a version bump. On CUDA
  the checksums are themselves one captured graph: one launch and one host read. A new hold's
checksums are launched right after the generation's last step is queued
(:func:`start_keep`) and read after its last sync, so the GPU runs them behind the steps and
the host does not wait for them.

None is kept for a model in training mode (sampling during training: the weights change between
calls, and the cache and graphs would only hold memory), under autocast with its weight cache on
(captured graphs would read cast copies that the autocast region frees), or for a model on several
devices.

After an eager prefill or a prefill's capture, :meth:`ModelCache.refilled_in_place` confirms that
every tensor kept its storage; if one did not, a new decoder is built and the report says why.
A replayed prefill runs no host code: hydra_kernels' and hydra_model's host-side diagnostics
(fallback and dispatch counters) do not count it. Copies and pickles of a model hold no decoder
(:class:`DecoderHold`). The decoder refers back to its model, so a model that holds one is freed
by the garbage collector, not at once on ``del``: ``model.release_decoder()`` frees the cache and
the graphs' memory right away.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hydra_kernels import kernel_options
from hydra_kernels.cuda_graph import graph_capture
from hydra_kernels.ops.checksum import checksums, words
from hydra_model.fused_decide import fused_decide_mode
from hydra_model.options import OPTIONS

#: tensors under this many elements are summed together (per element size)
SMALL_TENSOR = 1 << 18
#: prefill graphs a held decoder keeps (one per prompt length; the oldest goes first)
MAX_PREFILL_GRAPHS = 4
#: a kept decoder's cache capacity is a multiple of this: up to 63 masked positions a step's
#: attention reads in vain, for one decoder serving every total length in the bucket
CAPACITY_STEP = 64


def cache_capacity(total: int, max_seq_len: int) -> int:
    """The capacity of a kept decoder's cache for ``total`` positions (prompt + new tokens):
    rounded up to a multiple of :data:`CAPACITY_STEP`, but not past ``max_seq_len`` when ``total``
    fits in it (a longer cache would grow the rotary tables)."""
    rounded = -(-total // CAPACITY_STEP) * CAPACITY_STEP
    return min(rounded, max_seq_len) if total <= max_seq_len else rounded


def _walk(model: torch.nn.Module) -> tuple[list[torch.Tensor], tuple]:
    """(the tracked tensors, the routing rules) in one walk of the modules: the parameters, then
    the buffers but the ``stat_*`` statistics, each once and non-empty, in ``parameters()`` and
    ``named_buffers()`` order; and (name, static, rule, mode) of each module that has one of
    these. One walk instead of three: a new decoder takes it on the host before its first step
    (about 1.3 → 0.5 ms for HYDRA's 100M preset, measured on the CPU)."""
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    rules = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for key, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))  # first seen under a stat_ name: left out, as named_buffers() was
                if not key.startswith("stat_"):
                    buffers.append(b)
        if any(_has(m, attr) for attr in _RULE_ATTRS):
            rules.append((name, *(getattr(m, attr, None) for attr in _RULE_ATTRS)))
    return [t for t in (*params, *buffers) if t.numel()], tuple(rules)


_RULE_ATTRS = ("static", "rule", "mode")


def _has(m: torch.nn.Module, attr: str) -> bool:
    """``hasattr(m, attr)`` without Module.__getattr__'s AttributeError for a missing name (three
    per module made most of the walk's time); a module with a ``__getattr__`` of its own is asked."""
    if type(m).__getattr__ is not torch.nn.Module.__getattr__:
        return hasattr(m, attr)
    return (
        attr in m.__dict__
        or (hasattr(type(m), attr) and hasattr(m, attr))  # a property may raise AttributeError
        or attr in m._parameters
        or attr in m._buffers
        or attr in m._modules
    )


def _structure_of(tensors: list[torch.Tensor], rules: tuple) -> tuple:
    """Everything host-side a captured step depends on: storage, routing rules, switches."""
    layout = tuple((t.data_ptr(), tuple(t.shape), t.dtype, t.device) for t in tensors)
    return layout, rules, (repr(OPTIONS), repr(kernel_options), fused_decide_mode())


def _structure(model: torch.nn.Module) -> tuple:
    return _structure_of(*_walk(model))


#: decode steps whose every kernel ran in this process (:func:`warm_signature`)
_WARM: set[tuple] = set()


def warm_signature(
    model: torch.nn.Module,
    mode: str,
    batch: int,
    capacity: int,
    device: torch.device,
    structure: tuple | None = None,
) -> tuple:
    """What decides which kernels a decode step launches and at which shapes: the model's class,
    its tensors' shapes, dtypes and devices, its routing rules and the switches, the decode mode,
    batch and cache capacity, and the autocast and inference modes around the call (autocast
    makes the cache and the stream half precision). A decoder whose signature already ran its
    warm-up step in this process captures its step at once (decode_graphs.py): its kernels are
    compiled and tuned. ``structure``: the model's, when a :class:`Fingerprint` already took it."""
    layout, rules, switches = structure if structure is not None else _structure(model)
    shapes = tuple(entry[1:] for entry in layout)  # not the storage: a kernel is warm for a shape
    grad_modes = request_of(model, mode, batch, capacity, device)[-1]
    return type(model), mode, batch, capacity, shapes, rules, switches, grad_modes


def is_warm(signature: tuple) -> bool:
    return signature in _WARM


def mark_warm(signature: tuple) -> None:
    _WARM.add(signature)


class Fingerprint:
    """What a captured decode step depends on in a model (see the module docstring): the
    host-side :attr:`structure` and :meth:`content`, the raw-bit sums (one host read)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors, rules = _walk(model)
        self.structure = _structure_of(self.tensors, rules)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._sums: torch.Tensor | None = None
        self._calls = 0

    def matches(self, model: torch.nn.Module) -> bool:
        """The model's tensors and switches are those this fingerprint was taken of (host only)."""
        return _structure(model) == self.structure

    def _sum_all(self) -> torch.Tensor:
        """Each large tensor's checksum, and one over the small ones of each word type together
        (one concatenation instead of a launch each: on the host every launch costs)."""
        large, small = [], {}
        for t in self.tensors:
            if t.numel() < SMALL_TENSOR:
                w = words(t)  # flat (a copy where t is not contiguous)
                small.setdefault(w.dtype, []).append(w)
            else:
                large.append(t if t.is_contiguous() else t.contiguous())
        return checksums(large + [torch.cat(group) for group in small.values()])

    def content(self) -> tuple:
        """The sums, read on the host (see :meth:`sums`)."""
        return self.read(self.sums())

    @staticmethod
    def read(sums: torch.Tensor | None) -> tuple:
        """What :meth:`sums` launched, read on the host (a host sync)."""
        return () if sums is None else tuple(sums.tolist())

    def sums(self) -> torch.Tensor | None:
        """The sums on the device, launched and not read (None for a model with no tensors). On
        CUDA the first call runs them eagerly; the second captures them as one graph, which later
        calls replay (one launch)."""
        if not self.tensors:
            return None
        device = self.tensors[0].device
        self._calls += 1
        if device.type != "cuda" or self._calls == 1:
            return self._sum_all()
        if self._graph is None:
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph):
                    self._sums = self._sum_all()
            self._graph = graph
        self._graph.replay()
        return self._sums


class PrefillGraph:
    """A prompt length's prefill into a held cache, captured: restart, forward, last logits."""

    def __init__(self, model: torch.nn.Module, cache, input_ids: torch.Tensor) -> None:
        self.ids = input_ids.clone()
        self.seq_len = input_ids.shape[1]
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph):  # records only: run() replays it
            cache.restart(weights_checked=True)  # take() compared the fingerprint
            self.logits = model(self.ids, cache=cache).logits[:, -1]

    def run(self, cache, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt's last logits [B, V] (a buffer the next run overwrites). The host side of
        a restart and a prefill is its count alone: the slots keep their entries throughout."""
        self.ids.copy_(input_ids)
        self.graph.replay()
        cache.seq_len = self.seq_len
        return self.logits


class HeldDecoder:
    """A decoder kept between generations, with what it was captured for and its prefill graphs."""

    def __init__(self, decoder: Any, request: tuple, fingerprint: Fingerprint, content: tuple) -> None:
        self.decoder = decoder
        self.request = request
        self.fingerprint = fingerprint
        self.content = content
        self.prefills: dict[int, PrefillGraph | None] = {}  # None: seen once, or failed (see failed)
        self.failed: dict[int, str] = {}
        self.last_prefill = "eager"

    def prefill(self, model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the prompt's last logits [B, V], whether the cache was refilled in place) from a
        prefill into the restarted cache: a graph where this prompt length came before on CUDA,
        else eager. When an eager prefill replaced a cache tensor, the cache holds a valid prefill
        in new tensors, for a new decoder."""
        cache, s = self.decoder.cache, input_ids.shape[1]
        graph = self.prefills.get(s)
        if graph is None and s in self.prefills and s not in self.failed and input_ids.is_cuda:
            try:
                graph = self.prefills[s] = PrefillGraph(model, cache, input_ids)
                self.last_prefill = "graph captured"
            except Exception as err:  # reported; this length prefills eagerly from now on
                self.failed[s] = f"{type(err).__name__}: {err}"
            else:
                if not cache.refilled_in_place():  # the capture's prefill allocated a new tensor
                    self.prefills[s] = None
                    self.failed[s] = "the captured prefill replaced a cache tensor"
                    graph = None
        elif graph is not None:
            self.last_prefill = "graph"
        if graph is not None:
            return graph.run(cache, input_ids), True
        self.last_prefill = "eager" if s not in self.failed else f"eager (capture failed: {self.failed[s]})"
        cache.restart(weights_checked=True)  # take() compared the fingerprint
        logits = model(input_ids, cache=cache).logits[:, -1]
        in_place = cache.refilled_in_place()
        if in_place:
            self.seen(s)
        return logits, in_place

    def seen(self, seq_len: int) -> None:
        """An eager prefill of ``seq_len`` tokens ran: the next one is captured."""
        if seq_len not in self.prefills:
            while len(self.prefills) >= MAX_PREFILL_GRAPHS:
                del self.prefills[next(iter(self.prefills))]
            self.prefills[seq_len] = None


class DecoderHold:
    """The slot on a model that keeps its last decoder (``model._decoder_hold``). A copy or a
    pickle of the model gets an empty one: captured graphs are not copied."""

    def __init__(self) -> None:
        self.held: HeldDecoder | None = None

    def __deepcopy__(self, memo) -> DecoderHold:
        return DecoderHold()

    def __getstate__(self) -> dict:
        return {"held": None}


def hold_of(model: torch.nn.Module) -> DecoderHold:
    hold = model.__dict__.get("_decoder_hold")
    if hold is None:
        hold = model.__dict__["_decoder_hold"] = DecoderHold()
    return hold


def request_of(model: torch.nn.Module, mode: str, batch: int, capacity: int, device: torch.device) -> tuple:
    """What a held decoder must have been built for: decode mode, batch, cache capacity, device,
    dtype, and the autocast and inference modes around the call."""
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else None
    grad_modes = (autocast, dtype, torch.is_inference_mode_enabled())
    return mode, batch, capacity, device, model.embed.weight.dtype, grad_modes


def keepable(was_training: bool, device: torch.device) -> bool:
    """Whether a generation may keep its decoder: not for a model in training mode, not under
    autocast with its weight cache on (see the module docstring)."""
    autocast_cache = torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled()
    return not was_training and not autocast_cache


def take(model: torch.nn.Module, request: tuple) -> tuple[HeldDecoder | None, str | None]:
    """(the held decoder if it serves ``request`` on the model as it is now, else None; why a held
    decoder of the same request was not reused, else None). Either way the model holds none
    after: the caller keeps it again (:func:`start_keep`) once its generation has finished."""
    hold = hold_of(model)
    held, hold.held = hold.held, None
    if held is None or held.request != request:  # none, or another request: nothing stale
        return None, None
    try:
        same = held.fingerprint.matches(model) and held.fingerprint.content() == held.content
    except Exception as err:  # a fingerprint that cannot be taken: no reuse, and the report says so
        return None, f"the weights' fingerprint failed ({type(err).__name__}: {err})"
    if not same:
        return None, "the weights, buffers or switches changed since it was captured"
    return held, None


class PendingKeep:
    """Keeping a generation's decoder (:func:`start_keep`) in two halves: the fingerprint's
    kernels launched while the GPU still runs the generation's queued decode steps (the host,
    done queuing them, would otherwise wait), read by :meth:`finish` after the generation's
    last sync, which stores the hold."""

    def __init__(self, model: torch.nn.Module, held: HeldDecoder | None, pending=None) -> None:
        self.model, self.held, self._pending = model, held, pending

    def finish(self) -> None:
        if self._pending is not None:
            decoder, request, fingerprint, sums, prefill_len = self._pending
            try:
                content = fingerprint.read(sums)
            except Exception as err:  # the generation's tokens stand; this decoder is not kept
                warnings.warn(f"generate keeps no decoder: its fingerprint failed ({err})", stacklevel=3)
                return
            self.held = HeldDecoder(decoder, request, fingerprint, content)
            self.held.seen(prefill_len)
        if self.held is not None:
            hold_of(self.model).held = self.held


def start_keep(
    model: torch.nn.Module, held: HeldDecoder | None, decoder: Any, request: tuple, prefill_len: int
) -> PendingKeep:
    """Start holding ``decoder`` for the next generation of the same ``request``: ``held`` again
    where the generation reused it (its fingerprint was checked when it was taken), else a new
    hold whose fingerprint is launched now and read by :meth:`PendingKeep.finish`."""
    if held is not None and held.decoder is decoder:
        return PendingKeep(model, held)
    # the one a graphed decoder took when it was built, after the prefill (decode_graphs.py)
    fingerprint = getattr(decoder, "fingerprint", None) or Fingerprint(model)
    if len({t.device for t in fingerprint.tensors}) > 1:
        return PendingKeep(model, None)  # a model on several devices: not kept
    try:
        sums = fingerprint.sums()
    except Exception as err:  # the generation's tokens stand; this decoder is not kept
        warnings.warn(f"generate keeps no decoder: its fingerprint failed ({err})", stacklevel=3)
        return PendingKeep(model, None)
    return PendingKeep(model, None, (decoder, request, fingerprint, sums, prefill_len))


def release(model: torch.nn.Module) -> bool:
    """Drop the held decoder (its graphs and cache); True if there was one."""
    hold = hold_of(model)
    had, hold.held = hold.held is not None, None
    return had


def model_fingerprint(model: torch.nn.Module) -> tuple:
    """The structure and content :func:`take` compares (computed eagerly: for tests and benches)."""
    fingerprint = Fingerprint(model)
    return fingerprint.structure, fingerprint.content()  # a first call: eager
