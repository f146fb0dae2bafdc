"""The trainer's step as a CUDA graph: every micro-batch's forward and backward, clipping, the
finiteness check and the fused AdamW update, captured once and replayed.

The captured function is the trainer's own step body (:meth:`hydra_train.step.StepMixin.micro_step`),
the one the eager step runs; the capture mechanism is :class:`hydra_kernels.cuda_graph.CUDAGraphStep`.

Sequence after ``Trainer.enable_cuda_graphs(W)``: W-1 eager steps; at step W the step body runs
once for real on the capture stream (the warm-up call, so per-stream lazy state such as cuBLAS
workspaces exists before capture) and is captured right after (the capture runs nothing); every
later step copies its batches into the captured input buffers and replays.

What capture needs, and how it is met here:

* fixed shapes: the batch shape is fixed by the data plan; a different shape raises and the
  trainer drops the graph with that reason.
* no host syncs inside the step: the step has none with fused AdamW (the non-finite rule passes
  ``found_inf`` on the device); dynamic MoD/MoR routing is fixed-k top-k with no syncs, so it is
  captured as well (the pretests record whether that works for each model size).
* a capturable optimizer: torch's fused AdamW with ``capturable=True`` and the learning rate as a
  device tensor, which :class:`hydra_train.optim.LRSchedule` fills in place before each replay.
* static gradients: gradients are set to None before capture, so the captured backward writes
  fresh gradients into graph-owned buffers on every replay (no zeroing needed in the graph).
* outputs are graph buffers overwritten by the next replay: the step returns clones.
* autocast is the trainer's own, entered and left inside the captured region, so its weight-cast
  cache lives and dies within one step (each replay re-runs the casts on the current weights). It
  must be the same autocast state as the eager steps: functions compiled inside the model guard on
  it, and a recompilation during capture invalidates the capture.
* callbacks' ``on_after_backward`` is host code: the graphed body skips it (it would run once, at
  capture, and never again).
* under torchrun (DDP): the gradients are averaged inside the body by plain NCCL collectives
  (:mod:`hydra_train.data_parallel`; DDP's reducer cannot be captured), which NCCL lets a graph
  capture; the process group is up and has run collectives (DDP's construction broadcast, the
  eager steps) before any capture; torch keeps captured collectives away from its NCCL watchdog.
  Every rank must replay the same graph or none: a capture that fails on one rank is dropped on
  all (one all-reduce of a flag after each capture), and the ranks step eagerly together.

The loss-scale input (1.0: exact) is how a test reaches the gradients of a graphed step:
:meth:`GraphedStep.scale_next_loss` with NaN or Inf poisons the next graphed step
(:mod:`hydra_train.safe_opts.faults` uses it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hydra_kernels.cuda_graph import CUDAGraphStep
from hydra_train.data_parallel import capture_stream
from hydra_train.step import StepResult, supports_found_inf

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer


class CaptureError(RuntimeError):
    """The step could not be captured or replayed (the message says why)."""


def make_capturable(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch a fused torch AdamW to capturable mode with its lr as a device tensor."""
    for g in opt.param_groups:
        g["capturable"] = True
        lr = g["lr"]
        # a tensor lr elsewhere (a checkpoint saved while graphed loads it on the CPU) would be
        # read once at capture and never again: the graph must read a device tensor
        if not isinstance(lr, torch.Tensor) or lr.device != device:
            g["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    for st in opt.state.values():
        step = st.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            st["step"] = step.to(device)


def make_uncapturable(opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        g["capturable"] = False
        if isinstance(g["lr"], torch.Tensor):
            g["lr"] = float(g["lr"])  # one sync, at deactivation only


class GraphedStep:
    """The capture/replay state machine of one trainer (see the module docstring)."""

    def __init__(self, trainer: Trainer, warmup: int):
        self.tr = trainer
        self.warmup = max(1, int(warmup))
        self.eager_done = 0
        # the shared capture stream: under DDP the model's gradient-accumulation nodes live on it
        self.stream = capture_stream(trainer.device)
        self.graph: CUDAGraphStep | None = None
        self.pending_scale: float | None = None
        #: set when a capture failed after its warm-up call had applied the step
        self.failure: str | None = None
        self.captures = 0
        self.replays = 0
        #: whether the current call's optimizer step has run (set before its outputs are copied)
        self.step_applied = False

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def take_eager_step(self) -> bool:
        """Whether this step is one of the plain eager warm-up steps (counted as taken)."""
        if self.graph is None and self.eager_done < self.warmup - 1:
            self.eager_done += 1
            return True
        return False

    def scale_next_loss(self, value: float | None) -> None:
        """Multiply the loss of the next graphed step by ``value`` (None: leave it at 1)."""
        self.pending_scale = value

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """The warm-up-and-capture step, or a replay."""
        self.step_applied = False
        try:
            if not supports_found_inf(self.tr.optimizer):
                raise CaptureError("needs torch's fused AdamW; the optimizer was swapped (8bit_adam?)")
            if self.graph is None:
                return self._warm_up_and_capture(batches)
            return self._replay(batches)
        finally:
            self.pending_scale = None

    def _body(self, *flat: torch.Tensor) -> StepResult:
        *tensors, loss_scale = flat
        batches = list(zip(tensors[0::2], tensors[1::2], strict=True))
        return self.tr.micro_step(batches, loss_scale=loss_scale, hooks=False)

    def _inputs(self, batches: list) -> list[torch.Tensor]:
        flat = [t for xy in batches for t in xy]
        return [*flat, torch.ones((), device=self.tr.device)]

    def _warm_up_and_capture(self, batches: list) -> StepResult:
        tr = self.tr
        t0 = time.perf_counter()
        make_capturable(tr.optimizer, tr.device)
        graph = CUDAGraphStep.deferred(self._body, *self._inputs(batches), stream=self.stream)
        self._fill_scale(graph)
        try:
            out = graph.warm_up(1)  # this step, for real, on the capture stream
            self.step_applied = True
            res = out.clone()
        finally:
            self._fill_scale(graph, reset=True)
        tr.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates its own gradients
        failure = None
        try:
            graph.capture()
        except Exception as exc:
            failure = f"capture failed: {type(exc).__name__}: {str(exc)[:300]}"
        all_captured = self._all_ranks_captured(failure is None)  # every rank votes, once
        if failure is None and not all_captured:
            failure = "capture failed on another rank; every rank runs eagerly"
            graph.release()
        if failure is not None:
            tr.optimizer.zero_grad(set_to_none=True)  # gradients captured but never computed
            self.failure = failure
            return res
        self.graph = graph
        self.captures += 1
        if self.stream is not None:  # once a capture: its cost counted until the warm-up call ran
            self.stream.synchronize()
        tr.log(f"CUDA graph: the step captured at step {tr.step} in {time.perf_counter() - t0:.2f} s")
        return res

    def _all_ranks_captured(self, ok: bool) -> bool:
        """Under torchrun: whether every rank captured (one all-reduce, once per capture). A graph
        holding collectives must be replayed by every rank or by none, so a capture that failed on
        one rank is dropped on all of them and they step eagerly together."""
        if not self.tr.dist.enabled:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=self.tr.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _fill_scale(self, graph: CUDAGraphStep, reset: bool = False) -> None:
        if self.pending_scale is not None:
            graph.static_inputs[-1].fill_(1.0 if reset else self.pending_scale)

    def _replay(self, batches: list) -> StepResult:
        graph = self.graph
        n_captured = (len(graph.static_inputs) - 1) // 2
        if len(batches) != n_captured:
            raise CaptureError(f"{len(batches)} micro-batches, the graph was captured with {n_captured}")
        graph.load(*(t for xy in batches for t in xy), graph.static_inputs[-1])
        self._fill_scale(graph)
        try:
            out = graph.replay()
            self.step_applied = True
        finally:
            self._fill_scale(graph, reset=True)
        self.replays += 1
        return out.clone()

    def release(self) -> None:
        if self.graph is not None:
            self.tr.optimizer.zero_grad(set_to_none=True)  # the graph-owned gradient buffers
            self.graph.release()
        self.graph = None
