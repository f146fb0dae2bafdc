"""CUDA graphs: the whole optimizer step (every micro-batch's forward and backward, clipping, the
finiteness check, the fused AdamW update) captured once and replayed.

Sequence after activation (``--cuda_graphs_warmup W``): W real eager steps, the last one on the
capture stream (so per-stream lazy state such as cuBLAS workspaces exists before capture); at the
next step the step is captured (which runs nothing) and replayed on that step's batch; every
later step copies its batches into the captured input buffers and replays.

What capture needs, and how it is met here:

* fixed shapes: the batch shape is fixed by the data plan; a different shape raises and the
  optimization is disabled with that reason.
* no host syncs inside the step: the eager step has none with fused AdamW (the non-finite rule
  passes ``found_inf`` on the device); dynamic MoD/MoR routing is fixed-k top-k with no syncs, so
  it is captured as well (the pretests record whether that works for each model size).
* a capturable optimizer: torch's fused AdamW with ``capturable=True`` and the learning rate as a
  device tensor, which :class:`hydra_train.optim.LRSchedule` fills in place before each replay.
* static gradients: gradients are set to None before capture, so the captured backward writes
  fresh gradients into graph-owned buffers on every replay (no zeroing needed in the graph).
* outputs are graph buffers overwritten by the next replay: the step returns clones.
* autocast is the trainer's own, entered and left inside the captured region, so its weight-cast
  cache lives and dies within one step (each replay re-runs the casts on the current weights). It
  must be the same autocast state as the eager steps: functions compiled inside the model guard on
  it, and a recompilation during capture invalidates the capture.

Fault injection (tests, ``HYDRA_SAFEOPTS_INJECT``) reaches a captured step through a device
scalar multiplied into the loss before backward: 1.0 normally (exact), NaN or Inf to poison
the gradients of one replay.

``deactivate`` releases the graph (its memory pool with it), sets the gradients back to None
and returns the optimizer's learning rate to a Python float: the next step is eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hydra_train.safe_opts.registry import Optimization
from hydra_train.trainer import LossSums, StepResult, supports_found_inf

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer


class CaptureError(RuntimeError):
    """The step could not be captured or replayed (the message says why)."""


def make_capturable(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch a fused torch AdamW to capturable mode with its lr as a device tensor."""
    for g in opt.param_groups:
        g["capturable"] = True
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)
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
    """The capture/replay state machine for one trainer (see the module docstring)."""

    def __init__(self, trainer: Trainer, warmup: int):
        self.tr = trainer
        self.warmup = max(1, int(warmup))
        self.eager_done = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream = torch.cuda.Stream(trainer.device)
        self.poison = torch.ones((), device=trainer.device)
        self.static_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.out: StepResult | None = None
        self.captures = 0
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, batches: list, poison: float | None) -> StepResult | None:
        """One step. Returns None for an eager warmup step on the default stream (the caller runs
        the eager step, with its usual fault hooks); otherwise the result of this step."""
        if self.graph is None:
            if self.eager_done < self.warmup - 1:
                self.eager_done += 1
                return None
            if self.eager_done == self.warmup - 1:
                self.eager_done += 1
                return self._eager_on_capture_stream(batches)
            self._capture(batches)
        return self._replay(batches, poison)

    def _eager_on_capture_stream(self, batches: list) -> StepResult:
        cur = torch.cuda.current_stream(self.tr.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            res = self.tr.eager_step(batches)
        cur.wait_stream(self.stream)
        return res

    def _body(self) -> StepResult:
        tr = self.tr
        n = len(self.static_batches)
        sums = LossSums()
        for x, y in self.static_batches:
            with tr.autocast():
                out = tr.forward_model(x, y)
            (out.loss * self.poison / n).backward()
            sums.add(out, loss_scale=self.poison)
        grad_norm = tr._grad_norm()
        loss_mean, ce_mean, aux_mean = sums.means(n)
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss_mean)
        tr.apply_if_finite(finite)
        return StepResult(loss_mean, ce_mean, aux_mean, grad_norm, finite)

    def _capture(self, batches: list) -> None:
        tr = self.tr
        opt = tr.optimizer
        if not supports_found_inf(opt):
            raise CaptureError("needs torch's fused AdamW (it skips a non-finite step on the device)")
        make_capturable(opt, tr.device)
        self.static_batches = [(x.clone(), y.clone()) for x, y in batches]
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(tr.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                out = self._body()
        except Exception as exc:
            opt.zero_grad(set_to_none=True)  # gradients captured but never computed
            self.static_batches = []
            raise CaptureError(f"capture failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
        self.graph, self.out = graph, out
        self.captures += 1

    def _replay(self, batches: list, poison: float | None) -> StepResult:
        if len(batches) != len(self.static_batches):
            raise CaptureError(
                f"{len(batches)} micro-batches, the graph was captured with {len(self.static_batches)}"
            )
        for (sx, sy), (x, y) in zip(self.static_batches, batches, strict=True):
            if x.shape != sx.shape or y.shape != sy.shape:
                raise CaptureError(
                    f"batch shape {tuple(x.shape)} differs from the captured {tuple(sx.shape)}"
                )
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        if poison is not None:
            self.poison.fill_(poison)
        self.graph.replay()
        if poison is not None:
            self.poison.fill_(1.0)
        self.replays += 1
        o = self.out
        return StepResult(
            o.loss.clone(),
            o.ce_loss.clone(),
            {k: v.clone() for k, v in o.aux_losses.items()},
            o.grad_norm.clone(),
            o.finite.clone(),
        )

    def release(self) -> None:
        if self.graph is not None:
            self.tr.optimizer.zero_grad(set_to_none=True)  # the graph-owned gradient buffers
        self.graph = None
        self.out = None
        self.static_batches = []


class CudaGraphs(Optimization):
    name = "cuda_graphs"
    flag = "--experimental_cuda_graphs"
    title = "the whole training step captured as one CUDA graph and replayed"
    pretest_extra_warmup = 1  # the capture step
    probe_differs = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.step_runner: GraphedStep | None = None
        #: warmup steps of the next activation (pretests use fewer than --cuda_graphs_warmup)
        self.warmup = cfg.cuda_graphs_warmup

    def requested(self) -> bool:
        return self.cfg.experimental_cuda_graphs

    def not_applicable(self, trainer: Trainer) -> str | None:
        if trainer.device.type != "cuda":
            return "needs CUDA"
        if trainer.dist.enabled:
            return "single-process runs only (not under DDP/FSDP)"
        if not supports_found_inf(trainer.optimizer):
            return "needs torch's fused AdamW (bitsandbytes' AdamW8bit cannot skip a step on the device)"
        return None

    def activate(self, trainer: Trainer) -> None:
        self.step_runner = GraphedStep(trainer, self.warmup)
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        if self.step_runner is not None:
            self.step_runner.release()
            self.step_runner = None
            if trainer.device.type == "cuda":
                make_uncapturable(trainer.optimizer)
        self.active = False

    def invalidate(self, trainer: Trainer) -> None:
        """What the step computes changed: drop the graph, warm up and capture again."""
        if self.active and self.step_runner is not None:
            self.step_runner.release()
            self.step_runner = GraphedStep(trainer, self.warmup)

    def run_step(self, trainer: Trainer, batches: list, poison: float | None) -> StepResult | None:
        if not self.active or self.step_runner is None:
            return None
        if not supports_found_inf(trainer.optimizer):
            raise CaptureError("needs torch's fused AdamW; the optimizer was swapped (8bit_adam?)")
        return self.step_runner(batches, poison)

    def describe(self) -> dict[str, Any]:
        r = self.step_runner
        return {"warmup": self.warmup, **({"captures": r.captures, "replays": r.replays} if r else {})}
