"""Data-parallel gradient averaging by hand: what DDP's reducer does, as plain collectives that a
CUDA graph can capture.

DDP averages gradients from autograd hooks with host-side bucket bookkeeping, which a CUDA-graph
capture cannot record, so a graphed step cannot rely on it. :class:`GradAverager` does the same
arithmetic after the step's backward instead: each bucket of gradients is divided by the world
size and all-reduced (summed), exactly DDP's order of operations, so every rank ends with the mean
gradient of the combined batch, the gradient one process on that batch computes. It also
broadcasts the model's buffers from rank 0 before each step's first forward, which is what DDP's
forward does (``broadcast_buffers``), so buffers a forward moves (MoE's loss-free balancing bias)
stay equal on every rank; the ones the model asks DDP to leave alone
(``_ddp_params_and_buffers_to_ignore``: the causal routing thresholds' per-rank records, which
:meth:`hydra_train.step.StepMixin.apply_if_finite` all-reduces itself) are left alone here too.

``--ddp_grad_sync`` (:data:`GRAD_SYNC_MODES`) picks who averages under torchrun with DDP:

``auto``       DDP's reducer while the step runs eagerly; the hand-rolled averaging while the step
               is a CUDA graph (``cuda_graphs`` active), which is what lets DDP runs be graphed.
``reducer``    DDP's reducer always; ``cuda_graphs`` is then N/A under DDP.
``allreduce``  the hand-rolled averaging always, eager steps included (tests compare it on the CPU
               with gloo against one process on the combined batch).

The DDP wrapper is built in every mode (it broadcasts rank 0's weights at construction, and is
the eager fallback); while the hand-rolled averaging runs, every micro-batch runs under DDP's
``no_sync()``, where its hooks do nothing. Where a capture may follow, DDP is built on the stream
the graphs are captured on (:func:`capture_stream`): DDP keeps each parameter's
gradient-accumulation node alive, that node runs on the stream current at its creation, and a
node created on the default stream cannot join a capture (torch: "DDP must be constructed in a
side-stream context").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hydra_train.config import GRAD_SYNC_MODES, TrainConfig
from hydra_train.distributed import coalesced

__all__ = [
    "GRAD_SYNC_MODES",
    "GradAverager",
    "broadcast_buffers",
    "capture_stream",
    "graphed_ddp_possible",
    "synced_buffer_names",
    "why_not_graphed",
]

#: gradients per all-reduce: a few large collectives (the graph has no launch cost to hide), while
#: the staging buffer stays a fraction of the gradients' size
BUCKET_BYTES = 256 * 2**20

_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of ``device`` that every CUDA-graph warm-up and capture runs on, and
    that DDP is built on when a graph may capture its model (see the module docstring)."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs are captured on a CUDA stream; {device} has none")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _capture_streams[index]


def why_not_graphed(cfg: TrainConfig) -> str | None:
    """Why a multi-process step of this configuration cannot be a CUDA graph (None: it can, as DDP
    with the hand-rolled averaging)."""
    rt = cfg.runtime
    if rt.fsdp:
        return (
            "not under FSDP2: its sharded all-gathers and reduce-scatters are not captured here, so "
            "FSDP2 steps stay eager (DDP steps are graphed)"
        )
    if rt.ddp_grad_sync == "reducer":
        return (
            "--ddp_grad_sync reducer: DDP's reducer (autograd hooks, host-side buckets) cannot be "
            "captured (auto or allreduce graph DDP steps)"
        )
    if rt.ddp_find_unused_parameters:
        return (
            "DDP with find_unused_parameters: the captured all-reduce would give a parameter no rank "
            "used a zero gradient where DDP's reducer leaves it none"
        )
    return None


def graphed_ddp_possible(cfg: TrainConfig, device: torch.device, world_size: int) -> bool:
    """Whether this run's DDP steps may become CUDA graphs (DDP is then built for a capture)."""
    return (
        device.type == "cuda"
        and world_size > 1
        and bool(cfg.optimizations.experimental_cuda_graphs)
        and why_not_graphed(cfg) is None
    )


class GradAverager:
    """Average the gradients of ``params`` over the default process group, and broadcast
    ``model``'s buffers from rank 0 (module docstring). No host sync: capturable as it is."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        model: nn.Module,
        world_size: int,
        *,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"GradAverager needs a process group of 2 or more, got world size {world_size}")
        # what the model asks DDP to leave alone, parameters or buffers, is left alone here too
        ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        ignored = {id(p) for n, p in model.named_parameters() if n in ignore}
        self.params = [p for p in params if id(p) not in ignored]
        self.model = model
        self.world_size = world_size
        self.buckets = _plan_buckets(self.params, bucket_bytes)
        self._largest_bucket = max(
            (sum(self.params[i].numel() for i in b) for b in self.buckets if len(b) > 1), default=0
        )
        # one staging buffer per dtype, reused bucket after bucket; allocated at the first call,
        # which is always an eager step (a graph's warm-up precedes its capture), so that a graph
        # reads and writes the same persistent memory on every replay
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._buffer_names = synced_buffer_names(model)

    # -- gradients ------------------------------------------------------------------------------
    def average_gradients(self) -> None:
        """Every parameter's ``.grad`` becomes the mean over ranks (in place)."""
        for p in self.params:
            if p.grad is None:
                # every rank must hand the same tensors to the collectives, so a parameter this
                # rank did not use contributes zeros to the mean (DDP's reducer, without
                # find_unused_parameters, which this averaging is never used with, would stop).
                # One difference from one process: a parameter no rank used gets a zero gradient,
                # not None, so AdamW still decays it (weight decay, moments) that step
                p.grad = torch.zeros_like(p)
        for bucket in self.buckets:
            grads = [self.params[i].grad for i in bucket]
            if len(grads) == 1 and grads[0].is_contiguous():
                grads[0].div_(self.world_size)  # DDP's order: divide, then sum
                dist.all_reduce(grads[0], op=dist.ReduceOp.SUM)
                continue
            flat = self._staging_for(grads)
            views = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
            torch._foreach_copy_(views, grads)
            flat.div_(self.world_size)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            torch._foreach_copy_(grads, views)

    def _staging_for(self, grads: list[torch.Tensor]) -> torch.Tensor:
        n = sum(g.numel() for g in grads)
        dtype = grads[0].dtype
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self._largest_bucket), dtype=dtype, device=grads[0].device)
            self._staging[dtype] = buf
        return buf[:n]

    # -- buffers --------------------------------------------------------------------------------
    def broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank, one broadcast per dtype (DDP's pre-forward sync)."""
        broadcast_buffers(self.model, self._buffer_names)


def synced_buffer_names(model: nn.Module) -> list[str]:
    """The buffers DDP broadcasts from rank 0: all but those the model asks it to leave alone."""
    ignore = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    return [n for n, _ in model.named_buffers() if n not in ignore]


@torch.no_grad()
def broadcast_buffers(model: nn.Module, names: Sequence[str] | None = None) -> None:
    """Rank 0's buffers ``names`` (default :func:`synced_buffer_names`) on every rank, one
    broadcast per dtype. Also the step's own sync under FSDP2, which replicates buffers but never
    syncs them (:meth:`hydra_train.step.StepMixin.micro_step`)."""
    named = dict(model.named_buffers())
    # looked up by name every call: a module may replace a buffer tensor (a rebuilt table)
    names = synced_buffer_names(model) if names is None else names
    bufs = [named[n] for n in names if n in named and named[n].numel() > 0]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in bufs:
        by_dtype.setdefault(b.dtype, []).append(b)
    for group in by_dtype.values():
        coalesced(group, lambda flat: dist.broadcast(flat, src=0))


def _plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``params`` in buckets of one dtype each, up to ``bucket_bytes`` (a parameter at
    least that large is a bucket of its own, reduced in place without staging)."""
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        size = p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append([i])
            continue
        current, used = open_by_dtype.get(p.dtype, ([], 0))
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        open_by_dtype[p.dtype] = (current, used + size)
    buckets.extend(b for b, _ in open_by_dtype.values() if b)
    return buckets
