"""torchrun integration: process group, DDP / FSDP2 wrapping, gradient-sync control, full state dicts.

``torchrun --nproc_per_node=N -m hydra_train run ...`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``;
:func:`init_distributed` then joins the group (NCCL on CUDA, gloo on the CPU) and each rank uses
``cuda:LOCAL_RANK``. Without those variables everything here is a no-op single process. They are
read through :func:`hydra_train.options.torchrun_launch`, the one place that reads them.

DDP: gradients are all-reduced (averaged) on the last micro-batch of an accumulation only; the
others run under ``no_sync()``. A CUDA-graphed DDP step keeps DDP silent and averages by hand
(:mod:`hydra_train.data_parallel`). FSDP2 (``--fsdp``): every block in the model's ``nn.ModuleList``
children is ``fully_shard``-ed, then the root; ``set_requires_gradient_sync(False)`` plays the part
of ``no_sync``. Checkpoints always hold *full* state dicts (gathered with
``torch.distributed.checkpoint.state_dict``), so a checkpoint from N GPUs loads on one and back.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hydra_train.errors import short_error
from hydra_train.options import torchrun_launch


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return torchrun_launch().launched


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group when launched by torchrun with more than one process."""
    launch = torchrun_launch()
    if not launch.launched or launch.world_size <= 1:
        return DistInfo()
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = launch.local_rank
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # NCCL told which GPU is this rank's (it otherwise guesses from the global rank and warns
        # that a heterogeneous mapping can hang)
        device = torch.device("cuda", local_rank) if device_type == "cuda" else None
        dist.init_process_group(backend=backend, device_id=device)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def shutdown_distributed(info: DistInfo) -> None:
    """Destroy the process group, once what was built on it is freed (:func:`ending_together`).

    The trainer and its callbacks hold each other (SafeOptimizations keeps the trainer), so the
    DDP/FSDP model of a finished run lived on until the cycle collector ran, after the group's end:
    collected here, it goes first."""
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def ending_together(info: DistInfo) -> Iterator[None]:
    """Around a run under a process group: on success every rank meets in a barrier; on an
    exception, the frames it came through let go of what they hold before it goes on.

    The barrier: every rank done with its collectives before the group is destroyed (a rank
    tearing gloo down while another still talked to it aborted the process: "terminate called
    without an active exception", seen once in the 2-process FSDP test under load).

    The frames: an exception raised after DDP/FSDP wrapped the model (a refusal, a data error, a
    diverged run, a callback) kept the trainer and the wrapped model alive in its traceback past
    :func:`shutdown_distributed`. Freed after the group's end, DDP's reducer held the group's last
    reference: its destructor joined gloo's worker threads while holding the GIL, which a worker
    still freeing a collective's Python tensors waited for (gdb), and the rank hung at exit or
    aborted (SIGABRT): 10 of 40 two-rank runs refused right after wrapping, 0 of 60 with this.
    Clearing the frames' locals (the traceback still names every line) lets the collector free the
    run first; tests/hydra_train/test_ddp_failure_exit.py checks the order."""
    outer = sys.exc_info()[1]  # the caller's own exception, if it called from a handler: left alone
    try:
        yield
    except BaseException as exc:
        if info.enabled:
            _clear_frames(exc, outer)
        raise
    barrier(info)


def _clear_frames(exc: BaseException, outer: BaseException | None) -> None:
    """Clear the locals of every finished frame in ``exc``'s traceback and in those of the
    exceptions it chains to (``raise ... from``, one raised while handling another, a group's),
    up to ``outer``. A frame still running (the caller's) is left as it is."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or e is outer or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(info: DistInfo, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def fail_together(info: DistInfo) -> Iterator[None]:
    """Run a block (one with no collective in it) on every rank, then raise on every rank what
    the lowest failing rank's block raised: its type and message (or go on when none failed).

    A step one rank takes alone (rank 0 checks ``--resume``'s checkpoint and opens the metrics
    database: run.py) that raised ended that rank with a clear line, while the others, already in
    the next collective, died with a gloo "Connection closed by peer" traceback that buried the
    reason (NCCL hangs instead). One all-gather of every rank's outcome ends them all with the
    same error, so each exits as one process refusing would (cli_errors.py maps the type to the
    status). A ``KeyboardInterrupt`` is not gathered: torchrun sends it to every rank.

    A refusal raised after DDP or FSDP wrapped the model hung or aborted the rank's exit (7 of 45
    two-rank refusals of tests/hydra_train/test_ddp_refusals.py) until :func:`ending_together`
    freed the model before the process group's end. The start's checks refuse before wrapping
    (run.py); the database's first rows and a resume's restore are shared after it (run_start.py:
    not FSDP's own state loading, whose per-tensor collectives a gather must not cut into)."""
    if not info.enabled:
        yield
        return
    mine: Exception | None = None
    try:
        yield
    except Exception as exc:  # every failure: one not shared leaves the other ranks waiting
        mine = exc
    outcomes: list[Exception | None] = [None] * info.world_size
    dist.all_gather_object(outcomes, None if mine is None else _portable(mine, info.rank))
    first = next((r for r, o in enumerate(outcomes) if o is not None), None)
    if first is None:
        return
    if first == info.rank:
        raise mine  # this rank's own, with its traceback
    raise outcomes[first] from mine


def _portable(exc: Exception, rank: int) -> Exception:
    """``exc`` when it crosses to another process whole (the errors of errors.py, OSError); else a
    RuntimeError naming it (one whose arguments do not rebuild it, or that holds what cannot be
    pickled)."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    return RuntimeError(f"rank {rank} failed: {short_error(exc, 400)}")


def all_reduce_sum(info: DistInfo, t: torch.Tensor) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def coalesced(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], object]) -> None:
    """``collective`` (in place on one flat tensor) over ``tensors`` of one dtype at once: one
    call instead of one per tensor; the results are copied back into ``tensors``."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    collective(flat)
    parts = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(parts, tensors, strict=True)])


def wrap_model(
    model: nn.Module,
    info: DistInfo,
    *,
    fsdp: bool,
    device: torch.device,
    find_unused_parameters: bool = False,
    init_stream: torch.cuda.Stream | None = None,
) -> nn.Module:
    """The module the training forward goes through: ``model`` itself, DDP(model), or FSDP2(model).
    ``init_stream``: build DDP on that CUDA stream, the one CUDA graphs are captured on
    (:func:`hydra_train.data_parallel.capture_stream` says why)."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        # the routed blocks return a reshaped out-of-place result, which FSDP2 warns about because an
        # in-place op on it would lose its backward hook; none follows (the FSDP2 test compares
        # every gradient with one process's)
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(FSDPCCGQAMoDBlockWrapper\) returned a view tensor"
        )
        mesh = None
        if info.enabled or (dist.is_available() and dist.is_initialized()):
            from torch.distributed.device_mesh import init_device_mesh

            # on ``device``'s type: FSDP2's own default mesh is CUDA's wherever CUDA is present,
            # which moved a model meant for the CPU (a world of one) onto the GPU
            size = info.world_size if info.enabled else dist.get_world_size()
            mesh = init_device_mesh(device.type, (size,))
        for child in model.modules():
            if isinstance(child, nn.ModuleList):
                for block in child:
                    fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    if init_stream is None:
        return DDP(model, device_ids=ids, find_unused_parameters=find_unused_parameters)
    init_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(init_stream):
        ddp = DDP(model, device_ids=ids, find_unused_parameters=find_unused_parameters)
    torch.cuda.current_stream(device).wait_stream(init_stream)
    # eager steps now accumulate gradients on that stream, which recent torch versions warn about
    # once as a likely mistake; here it is the documented way to let a later capture include DDP's model
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)
    return ddp


def grad_sync(wrapped: nn.Module, enabled: bool):
    """Context for one micro-batch: gradient all-reduce on (last micro-batch) or off (the others)."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(wrapped)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def is_fsdp(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "reshard")


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return model.state_dict()


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return optimizer.state_dict()


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: dict[str, Any],
    optim_state: dict[str, Any] | None,
) -> None:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=opts)
        if optimizer is not None and optim_state is not None:
            optim_state = optimizer_state_by_name(model, optimizer, optim_state)
            set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
        return
    model.load_state_dict(model_state)
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(optim_state)


def optimizer_state_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """``state`` with its parameters named as ``get_optimizer_state_dict`` names them, the only
    layout FSDP2's ``set_optimizer_state_dict`` loads. One process and DDP save
    ``optimizer.state_dict()``, which numbers the parameters in the optimizer's order instead, so
    resuming such a checkpoint with ``--fsdp`` failed (``KeyError: 'state.0.step'``). The numbers
    map to this optimizer's parameters in order, as ``Optimizer.load_state_dict`` maps them (the
    run builds its groups from the model the same way); a state already by name is returned as it is."""
    groups = state.get("param_groups", [])
    saved = [i for g in groups for i in g["params"]]
    if not any(isinstance(i, int) for i in saved):
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    current = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes[0] != sizes[1]:
        raise ValueError(f"the saved optimizer's groups hold {sizes[0]} parameters, this run's {sizes[1]}")
    by_name = dict(zip(saved, current, strict=True))
    return {
        **state,
        "state": {by_name[i]: v for i, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [by_name[i] for i in g["params"]]} for g in groups],
    }
