"""The training loop. The Trainer owns the step (:mod:`hydra_train.step`: one body, run eagerly
or as a CUDA graph), its state (:mod:`hydra_train.trainer_state`) and the loop around it: data,
the LR schedule, callbacks, logging, evaluation and checkpoints.

Swappable at run time (between steps), which is how optional optimizations act on a run
(:mod:`hydra_train.safe_opts` applies them once the model and optimizer are built and a resume is
applied, and switches them off when its monitor says so):

``trainer.forward_model``  the module the training forward calls: the model, its DDP/FSDP wrapper,
                           or a ``torch.compile`` of either. Replace it to switch compiled <-> eager.
                           It is called as ``forward_model(x, y, **trainer.forward_kwargs)``:
                           ``return_logits=False`` for a model that takes it (the losses alone).
``trainer.enable_cuda_graphs(warmup)`` / ``disable_cuda_graphs()``  the step as a CUDA graph.
``trainer.optimizer``      replace with :meth:`Trainer.set_optimizer` so the LR schedule follows.
``trainer.loader``         the batch source (a :class:`hydra_train.prefetch.Prefetcher`).
``trainer.step_impl``      ``step_impl(batches) -> StepResult``, one optimizer step; default
                           :meth:`Trainer.run_step`. Whatever it is, it must never apply a step
                           whose gradients are not all finite, and must report ``finite=False``
                           (tests wrap it: :mod:`hydra_train.safe_opts.faults`).
``trainer.callbacks``      :class:`hydra_train.callbacks.CallbackList` (see that module).

Ctrl-C and SIGTERM (:class:`hydra_train.run_guard.RunSignals`): a first signal while the loop
runs is a request (:meth:`Trainer.interrupt`); the loop stops at the next step boundary (under
torchrun: the boundary every rank agreed on, :mod:`hydra_train.trainer_interrupt`), that step is
saved as a ``--save_every`` checkpoint is, and the signal's exception is raised (status
"interrupted", exit 130 or 143). Before the loop there is no step to save: the signal raises at
once. An interrupted step gets no evaluation of its own, so a resume from its checkpoint
continues as the uninterrupted run (the same weights, losses and validation history); the log
row written at the interrupted step is one the uninterrupted run does not have, and its loss can
become the best training loss recorded.

Skipped (non-finite) steps are counted (``skipped_steps``), logged, and still advance the data and
the LR schedule. Host syncs: none per step in the eager path with fused AdamW; losses, norms and
EMAs stay on the device and are read at log intervals (``--log_every``), evaluations and saves.
Under torchrun the ranks' interrupt vote (one one-element all-reduce a step) is read a step later,
once the previous step's kernels are done: the current step's stay queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hydra_train.callbacks import CallbackList, StepMetrics
from hydra_train.config import TrainConfig
from hydra_train.data_parallel import GradAverager, broadcast_buffers
from hydra_train.distributed import DistInfo, all_reduce_sum
from hydra_train.graphed_step import GraphedStep
from hydra_train.optim import LRSchedule
from hydra_train.prefetch import Prefetcher
from hydra_train.run_guard import interrupt_error
from hydra_train.step import LossSums, StepMixin, StepResult, loss_only_kwargs, supports_found_inf
from hydra_train.trainer_interrupt import InterruptVote
from hydra_train.trainer_state import EMA_ALPHAS, LoopState, TrainerStateMixin

__all__ = [
    "EMA_ALPHAS",
    "LoopState",
    "LossSums",
    "StepResult",
    "Trainer",
    "supports_found_inf",
]


class Trainer(StepMixin, TrainerStateMixin):
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        loader: Prefetcher,
        val_batches: list,
        device: torch.device,
        dist_info: DistInfo | None = None,
        wrapped: nn.Module | None = None,
        callbacks: CallbackList | None = None,
        run_id: str = "run",
        model_id: str = "model",
        log: Callable[[str], None] = print,
    ):
        self.model = model  # the plain module: config, state dict, routing stats
        # causal routing thresholds move once per optimizer step that is applied (apply_if_finite),
        # not once per forward: micro-batches share one τ and a skipped step leaves it unchanged
        if hasattr(model, "commit_router_thresholds"):
            model.threshold_commit = "manual"
        self.wrapped = wrapped if wrapped is not None else model  # DDP/FSDP wrapper (gradient sync)
        self.forward_model: nn.Module = self.wrapped
        self.forward_kwargs = loss_only_kwargs(model)  # the losses alone, where the model can
        self.cfg = cfg
        self.optimizer = optimizer
        self.schedule = schedule
        self.loader = loader
        self.val_batches = val_batches
        self.device = device
        self.dist = dist_info or DistInfo()
        self.callbacks = callbacks or CallbackList()
        self.run_id, self.model_id = run_id, model_id
        self.log = log
        self._init_state(device)
        self.step_impl: Callable[[list], StepResult] = self.run_step
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cuda_graphs: GraphedStep | None = None
        self.grad_averager: GradAverager | None = None  # hydra_train.step: who averages gradients
        self.sync_grad_averager()
        self.graph_failures: list[str] = []  # why each CUDA graph was dropped (callbacks report it)
        self.stop_reason: str | None = None
        self.interrupt_signal: int | None = None  # a signal this rank took as a stop request
        self.interrupted_by: int | None = None  # the signal every rank agreed to stop and save for
        self._looping = False  # whether a signal can become a stop request (interrupt)
        self._vote = InterruptVote(device) if self.dist.enabled else None
        self.status = "running"
        self._autocast_dtype = torch.bfloat16 if cfg.runtime.precision == "bf16" else None
        self.tokens_per_step = (
            cfg.data.batch_size * cfg.data.seq_len * cfg.optim.grad_accum * self.dist.world_size
        )
        self.last_log: dict[str, Any] = {}
        self.train_time_s = 0.0
        self.saver: Callable[[Trainer, bool], Path | None] | None = None
        self._session_start_step = 0
        self._step_phase = schedule.phase()  # the schedule phase of the last step run (its log row)

    # -- seams --------------------------------------------------------------------------------

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Swap the optimizer; the schedule re-attaches and keeps its position."""
        self.optimizer = optimizer
        self.schedule.attach(optimizer)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (a callback may call this); under torchrun, a request on
        any rank stops every rank after the next log step (``--log_every``: :meth:`_stop_agreed`)."""
        self.stop_reason = reason

    def interrupt(self, signum: int) -> bool:
        """Take ``signum`` (SIGINT, SIGTERM) as a request to stop at the next step boundary, save
        that step and raise the signal's exception (the module docstring). Called from the signal
        handler (:class:`hydra_train.run_guard.RunSignals`), so it only records. False outside
        the loop: there is no step to save, and the handler raises at once."""
        if not self._looping:
            return False
        self.interrupt_signal = signum
        return True

    @contextlib.contextmanager
    def recording_status(self) -> Iterator[None]:
        """Inside: an exception sets ``status`` ("interrupted" for Ctrl-C or SIGTERM, else
        "failed") before it propagates. The loop runs in it; so does anything the runner does to
        the trainer before the loop (the optimizations' pretests)."""
        try:
            yield
        except KeyboardInterrupt:
            self.status = "interrupted"
            raise
        except BaseException:
            self.status = "failed"
            raise

    # -- the loop -----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Train to ``--max_steps`` (or a stop request); returns :meth:`summary`."""
        self._session_start_step = self.step
        try:
            # a Ctrl-C or SIGTERM during the first evaluation still ends the run "interrupted"
            # rather than leaving it "running"
            with self.recording_status():
                self.callbacks.call("on_train_start", self)
                if self.step == 0 and not self.state.val_history and self.val_batches:
                    self.evaluate_and_record()
                self._loop()
                if self.interrupted_by is not None:
                    # a --save_every checkpoint of this step (every rank: FSDP gathers for it), then
                    # the interrupt, which recording_status turns into the "interrupted" status
                    self.save_checkpoint()
                    raise interrupt_error(self.interrupted_by)
                self.status = "finished" if self.stop_reason is None else "stopped"
        finally:
            self.loader.close()
        return self.summary()

    def _loop(self) -> None:
        self._looping = True  # from here to the loop's end a first signal asks to stop (interrupt)
        try:
            self._steps()
        finally:
            self._looping = False

    def _steps(self) -> None:
        cfg = self.cfg
        excluded = 0.0  # eval and save time inside the current log interval
        steps_since_log = 0
        t_prev_step = t_last_log = time.perf_counter()
        stopping = self._stop_agreed(True)  # a stop asked before the first step
        while self.step < cfg.runtime.max_steps and not stopping:
            batches = [self.loader.next() for _ in range(cfg.optim.grad_accum)]
            res = self.step_impl(batches)
            # what this step ran with, read before the schedule moves on to the next step's lr
            lr, self._step_phase = self.schedule.get_last_lr()[0], self.schedule.phase()
            self.schedule.step()
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self._update_ema(res.loss, res.finite)
            now = time.perf_counter()
            metrics = StepMetrics(
                self.step,
                res.loss,
                res.ce_loss,
                res.aux_losses,
                res.grad_norm,
                res.finite,
                lr=lr,
                tokens=self.tokens_per_step,
                tokens_per_s=self.tokens_per_step / max(now - t_prev_step, 1e-9),
            )
            t_prev_step = now
            steps_since_log += 1
            self.callbacks.call("on_step_end", self.step, metrics)
            # at the last step too, so that every rank reports the same status
            stopping = self._stop_agreed(
                self.step % cfg.runtime.log_every == 0 or self.step >= cfg.runtime.max_steps
            )
            stopping = self._interrupt_agreed() or stopping
            last = self.step >= cfg.runtime.max_steps or stopping
            saving = bool(cfg.runtime.save_every) and self.step % cfg.runtime.save_every == 0
            if self.step % cfg.runtime.log_every == 0 or last or saving:
                self.check_skip_streak()
                self._ema_over_ranks()
            if self.step % cfg.runtime.log_every == 0 or last:
                row = self._log_row(self._mean_over_ranks(metrics))  # syncs
                now = time.perf_counter()
                interval = max(now - t_last_log - excluded, 1e-9)
                row["tokens_per_s"] = steps_since_log * self.tokens_per_step / interval
                self.train_time_s += interval
                self.last_log = row
                self.callbacks.call("on_log", self.step, row)
                t_last_log, excluded, steps_since_log = time.perf_counter(), 0.0, 0
                t_prev_step = t_last_log
            t0 = time.perf_counter()
            # no final evaluation for an interrupt: the resumed run evaluates where the
            # uninterrupted one does (and the seconds before a preemption's SIGKILL go to the save)
            final_eval = last and self.interrupted_by is None
            if self.val_batches and (self.step % cfg.runtime.eval_every == 0 or final_eval):
                self.evaluate_and_record()
            if cfg.runtime.save_every and self.step % cfg.runtime.save_every == 0 and not last:
                self.save_checkpoint()
            spent = time.perf_counter() - t0
            excluded += spent
            t_prev_step += spent

    def _stop_agreed(self, sync_point: bool) -> bool:
        """Whether to stop after this step. One process: as soon as :meth:`request_stop` was
        called. Under torchrun every rank must stop after the same step: a rank stopping alone
        ran its final evaluation and save against the others' next step, collectives that do not
        pair (gloo aborted the process, NCCL hangs) and the final checkpoint was lost. A request
        on any rank stops every rank at the next log step (``--log_every``), where the ranks
        sync anyway (one small all-reduce; the reason is then shared)."""
        if not self.dist.enabled:
            return self.stop_reason is not None
        if not sync_point:
            return False
        flag = torch.tensor([float(self.stop_reason is not None)], device=self.device)
        if not bool(all_reduce_sum(self.dist, flag)):
            return False
        reasons: list[str | None] = [None] * self.dist.world_size
        torch.distributed.all_gather_object(reasons, self.stop_reason)
        self.stop_reason = next(r for r in reasons if r is not None)  # the lowest asking rank's
        return True

    def _interrupt_agreed(self) -> bool:
        """Whether to stop after this step for a signal (:meth:`interrupt`): one process as soon
        as it came; under torchrun when every rank agreed, through a vote every step
        (:mod:`hydra_train.trainer_interrupt` says why not at log steps). At ``--max_steps`` the
        run ends as it would have: finished, its final checkpoint written."""
        mine = self.interrupt_signal
        agreed = mine if self._vote is None else self._vote.agreed_then_vote(mine)
        if agreed is not None and self.step < self.cfg.runtime.max_steps:
            self.interrupted_by = agreed
        return self.interrupted_by is not None

    def _mean_over_ranks(self, m: StepMetrics) -> StepMetrics:
        """Loss terms averaged over ranks for logging (``on_step_end`` sees this rank's values)."""
        if not self.dist.enabled:
            return m
        names = sorted(m.aux_losses)
        t = torch.stack([m.loss, m.ce_loss, *(m.aux_losses[k] for k in names)]).float()
        all_reduce_sum(self.dist, t)
        t = t / self.dist.world_size
        return dataclasses.replace(
            m, loss=t[0], ce_loss=t[1], aux_losses=dict(zip(names, t[2:], strict=True))
        )

    def _ema_over_ranks(self) -> None:
        """Every rank's loss EMAs become their mean over ranks, before a log row or a checkpoint
        reads them. Each rank's EMAs follow its own micro-batches' loss; the EMAs are linear in
        the losses and every rank applies or skips the same steps, so their mean is the EMA of the
        rank-averaged loss, the one the log row reports (rank 0's alone was logged and saved)."""
        if self.dist.enabled:
            self._ema = all_reduce_sum(self.dist, self._ema.clone()) / self.dist.world_size

    def _log_row(self, m: StepMetrics) -> dict[str, Any]:
        vals = m.as_floats()
        ema = self.ema_values()
        aux = vals["aux"]
        row = {
            "step": self.step,
            "time": time.time(),
            "loss": vals["loss"],
            "ce_loss": vals["ce_loss"],
            "aux_loss": sum(aux.values()) if aux else 0.0,
            "aux": aux,
            "lr": m.lr,
            "grad_norm": vals["grad_norm"],
            "finite": vals["finite"],
            "tokens_seen": self.state.tokens_seen,
            "memory_mb": self.memory_mb(),
            "skipped_steps": self.skipped_steps(),
            "ema_short": ema[0],
            "ema_medium": ema[1],
            "ema_long": ema[2],
            "lr_phase": self._step_phase,
            "base_lr": self.schedule.base_lr(),
        }
        if math.isfinite(vals["loss"]):
            self.state.best_loss = min(self.state.best_loss, vals["loss"])
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the fixed validation batches (all ranks)."""
        if self.dist.enabled:
            # every rank evaluates rank 0's model, the one a checkpoint holds: a buffer a training
            # forward moves from this rank's own data comes back to rank 0's only before the next
            # step's first forward (MoE's loss-free balancing bias is kept equal by the step itself:
            # hydra_train.step.StepMixin._sum_balance_loads)
            broadcast_buffers(self.model)
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            for x, y in self.val_batches:
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
                with self.autocast():
                    out = self.model(x, y)
                n = (y != -100).sum()
                total[0] += out.ce_loss.double() * n
                total[1] += n
        finally:
            self.model.train(was_training)
        all_reduce_sum(self.dist, total)
        return float(total[0] / total[1].clamp_min(1))

    def evaluate_and_record(self) -> float:
        val = self.evaluate()
        self.state.val_history.append((self.step, val))
        self.callbacks.call("on_eval", self.step, val)
        return val
