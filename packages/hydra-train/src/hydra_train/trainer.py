"""The training loop, with the seams SafeOptimizations plugs into.

Swappable at run time (between steps):

``trainer.forward_model``  the module the training forward calls: the model, its DDP/FSDP wrapper,
                           or a ``torch.compile`` of either. Replace it to switch compiled <-> eager.
``trainer.step_impl``      a callable ``step_impl(batches) -> StepResult`` doing one optimizer step
                           (forward and backward of every micro-batch, clipping, the finiteness
                           check, the optimizer). Default :meth:`Trainer.eager_step`; a CUDA-graph
                           replay can take its place. Whatever it is, it must never apply a step
                           whose gradients are not all finite, and must report ``finite=False``.
``trainer.optimizer``      replace with :meth:`Trainer.set_optimizer` so the LR schedule follows.
``trainer.callbacks``      :class:`hydra_train.callbacks.CallbackList` (see that module).

The non-finite rule: ``finite = isfinite(total grad norm) & isfinite(loss)``, one fused reduction
(the grad-norm computation already visits every gradient); under DDP/FSDP only the norm of the
synchronised gradients decides, so that every rank takes the same decision. A fused torch Adam/AdamW receives
``found_inf = ~finite`` and skips the update *on the device* (weights, moments and step count
untouched), so the loop needs no host sync; other optimizers are stepped only after reading the
flag (one sync). Skipped steps are counted (``skipped_steps``), logged, and still advance the data
and the LR schedule.

Host syncs: none per step in the eager path with fused AdamW. Losses, norms and EMAs stay on the
device and are read at log intervals (``--log_every``), evaluations and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hydra_train.callbacks import CallbackList, StepMetrics
from hydra_train.checkpoint import (
    FORMAT,
    VERSION,
    ResumePoint,
    capture_rng,
    check_model_config,
    restore_rng,
)
from hydra_train.config import TrainConfig
from hydra_train.distributed import (
    DistInfo,
    all_reduce_sum,
    full_model_state,
    full_optimizer_state,
    grad_sync,
    load_full_state,
)
from hydra_train.errors import HydraDivergedError
from hydra_train.optim import LRSchedule
from hydra_train.prefetch import Prefetcher

EMA_ALPHAS = (0.99, 0.999, 0.9999)


@dataclass
class StepResult:
    """What a ``step_impl`` returns; tensors on the training device."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    aux_losses: dict[str, torch.Tensor]
    grad_norm: torch.Tensor
    finite: torch.Tensor


class LossSums:
    """Running sums of the detached fp32 losses (total, CE, each auxiliary term) of one step's
    micro-batches; the eager step and the CUDA-graph body both accumulate through this."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.ce: torch.Tensor | None = None
        self.aux: dict[str, torch.Tensor] = {}

    def add(self, out: Any, loss_scale: torch.Tensor | None = None) -> None:
        """Add one forward's losses; ``loss_scale`` multiplies the total (the fault injector's poison)."""
        loss = out.loss.detach().float()
        if loss_scale is not None:
            loss = loss * loss_scale
        ce = out.ce_loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss
        self.ce = ce if self.ce is None else self.ce + ce
        for k, v in out.aux_losses.items():
            v = v.detach().float()
            self.aux[k] = v if k not in self.aux else self.aux[k] + v

    def means(self, n: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, CE, auxiliary terms) averaged over ``n`` micro-batches."""
        return self.loss / n, self.ce / n, {k: v / n for k, v in self.aux.items()}


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done (applied or skipped)
    tokens_seen: int = 0
    val_history: list[tuple[int, float]] = field(default_factory=list)
    best_loss: float = math.inf


def supports_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Fused torch Adam/AdamW skip their update on device when ``found_inf`` is set."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and bool(opt.defaults.get("fused"))


class Trainer:
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
        self.state = LoopState()
        self.step_impl: Callable[[list], StepResult] = self.eager_step
        self.stop_reason: str | None = None
        self.status = "running"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._alphas = torch.tensor(EMA_ALPHAS, dtype=torch.float64, device=device)
        self._ema = torch.zeros(3, dtype=torch.float64, device=device)
        self._ema_count = torch.zeros((), dtype=torch.float64, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        # skipped steps in a row ending at the current step (on the device: read at log/save points)
        self._streak = torch.zeros((), dtype=torch.int64, device=device)
        self._autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world_size
        self.last_log: dict[str, Any] = {}
        self.train_time_s = 0.0
        self.saver: Callable[[Trainer, bool], Path | None] | None = None
        self._session_start_step = 0

    # -- seams --------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.state.step

    def set_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Swap the optimizer; the schedule re-attaches and keeps its position."""
        self.optimizer = optimizer
        self.schedule.attach(optimizer)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (a callback may call this)."""
        self.stop_reason = reason

    def autocast(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    # -- one step -----------------------------------------------------------------------------

    def eager_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        n = len(batches)
        sums = LossSums()
        for i, (x, y) in enumerate(batches):
            with grad_sync(self.wrapped, enabled=i == n - 1):
                with self.autocast():
                    out = self.forward_model(x, y)
                (out.loss / n).backward()
            sums.add(out)
        self.callbacks.call("on_after_backward", self.step + 1, self.model)
        grad_norm = self._grad_norm()
        loss_mean, ce_mean, aux_mean = sums.means(n)
        finite = torch.isfinite(grad_norm)
        if not self.dist.enabled:  # ranks decide from the synchronised gradients only, so they agree
            finite = finite & torch.isfinite(loss_mean)
        self.apply_if_finite(finite)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_mean, ce_mean, aux_mean, grad_norm, finite)

    def _grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        return norm.float()

    def apply_if_finite(self, finite: torch.Tensor) -> None:
        """Step the optimizer unless ``finite`` is False (see the module docstring)."""
        opt = self.optimizer
        if supports_found_inf(opt):
            opt.found_inf = (~finite).to(torch.float32)
            try:
                opt.step()
            finally:
                opt.found_inf = None
        elif bool(finite):  # host sync: this optimizer cannot skip on its own
            opt.step()
        self._commit_router_thresholds(finite)

    def _commit_router_thresholds(self, applied: torch.Tensor) -> None:
        """Causal routing: fold this step's router statistics into the thresholds, summed over
        ranks first so that every rank keeps the same τ (one all-reduce for all of them)."""
        commit = getattr(self.model, "commit_router_thresholds", None)
        if commit is None:
            return
        records = self.model.router_threshold_records()
        if self.dist.enabled and records:
            flat = torch.cat([r.reshape(-1) for r in records])
            all_reduce_sum(self.dist, flat)
            torch._foreach_copy_(records, list(flat.split([r.numel() for r in records])))
        commit(applied)

    # -- the loop -----------------------------------------------------------------------------

    def _update_ema(self, loss: torch.Tensor, finite: torch.Tensor) -> None:
        f = finite.to(torch.float64)
        new = self._ema * self._alphas + (1 - self._alphas) * torch.nan_to_num(loss.double())
        self._ema = torch.where(finite, new, self._ema)
        self._ema_count = self._ema_count + f
        self._skipped = self._skipped + (~finite).to(torch.int64)
        self._streak = torch.where(finite, torch.zeros_like(self._streak), self._streak + 1)

    def check_skip_streak(self) -> None:
        """Stop (:class:`HydraDivergedError`) once more than ``--max_skipped_steps`` optimizer steps in
        a row were skipped for non-finite loss or gradients (one host sync)."""
        streak = int(self._streak)
        if streak > self.cfg.max_skipped_steps:
            first = self.step - streak + 1
            raise HydraDivergedError(
                f"training diverged: {streak} steps in a row ({first}-{self.step}) had non-finite "
                f"loss or gradients (limit --max_skipped_steps {self.cfg.max_skipped_steps}); stopped "
                f"at step {self.step}. Lower --lr or --grad_clip and resume from the last checkpoint"
            )

    def ema_values(self) -> list[float]:
        """Bias-corrected short/medium/long EMAs of the loss (syncs)."""
        denom = 1 - torch.pow(self._alphas, self._ema_count)
        vals = torch.where(
            denom > 0, self._ema / denom.clamp_min(1e-300), torch.full_like(self._ema, math.nan)
        )
        return vals.tolist()

    def skipped_steps(self) -> int:
        return int(self._skipped)

    def memory_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        self._session_start_step = self.step
        excluded = 0.0  # eval and save time inside the current log interval
        steps_since_log = 0
        try:
            # inside the try: a Ctrl-C or SIGTERM during the pretests or the first evaluation
            # still ends the run "interrupted" rather than leaving it "running"
            self.callbacks.call("on_train_start", self)
            if self.step == 0 and not self.state.val_history and self.val_batches:
                self.evaluate_and_record()
            t_start = time.perf_counter()
            t_prev_step = t_last_log = t_start
            while self.step < cfg.max_steps and self.stop_reason is None:
                batches = [self.loader.next() for _ in range(cfg.grad_accum)]
                res = self.step_impl(batches)
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
                    lr=self.schedule.get_last_lr()[0],
                    tokens=self.tokens_per_step,
                    tokens_per_s=self.tokens_per_step / max(now - t_prev_step, 1e-9),
                )
                t_prev_step = now
                steps_since_log += 1
                self.callbacks.call("on_step_end", self.step, metrics)
                last = self.step >= cfg.max_steps or self.stop_reason is not None
                saving = bool(cfg.save_every) and self.step % cfg.save_every == 0
                if self.step % cfg.log_every == 0 or last or saving:
                    self.check_skip_streak()
                if self.step % cfg.log_every == 0 or last:
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
                if self.val_batches and (self.step % cfg.eval_every == 0 or last):
                    self.evaluate_and_record()
                if cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    self.save_checkpoint()
                spent = time.perf_counter() - t0
                excluded += spent
                t_prev_step += spent
            self.status = "finished" if self.stop_reason is None else "stopped"
        except KeyboardInterrupt:
            self.status = "interrupted"
            raise
        except BaseException:
            self.status = "failed"
            raise
        finally:
            self.loader.close()
        return self.summary()

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
            "lr_phase": self.schedule.phase(),
            "base_lr": self.schedule.base_lr(),
        }
        if math.isfinite(vals["loss"]):
            self.state.best_loss = min(self.state.best_loss, vals["loss"])
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the fixed validation batches (all ranks)."""
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

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "val_history": [list(v) for v in self.state.val_history],
            "best_loss": self.state.best_loss,
            "ema": self._ema.cpu(),
            "ema_count": self._ema_count.cpu(),
            "skipped": self._skipped.cpu(),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.state = LoopState(
            int(s["step"]),
            int(s["tokens_seen"]),
            [(int(a), float(b)) for a, b in s["val_history"]],
            float(s["best_loss"]),
        )
        self._ema = s["ema"].to(self.device, torch.float64)
        self._ema_count = s["ema_count"].to(self.device, torch.float64)
        self._skipped = s["skipped"].to(self.device, torch.int64)

    def checkpoint_payload(self, model_config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint dict (collective under FSDP: every rank must call it)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "time": time.time(),
            "run_id": self.run_id,
            "model_id": self.model_id,
            "model_size": self.cfg.model_size,
            "model": full_model_state(self.model),
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.schedule.state_dict(),
            "rng": capture_rng(),
            "data": {"position": self.loader.position, "seed": self.cfg.seed},
            "trainer": self.state_dict(),
            "config": {"model": model_config, "train": self.cfg.to_dict()},
            "callbacks": self.callbacks.state_dict(),
        }

    def save_checkpoint(self, final: bool = False) -> Path | None:
        """Write a step (or the final) checkpoint through ``self.saver`` (set by the runner)."""
        return self.saver(self, final) if self.saver is not None else None

    def resume_from(self, point: ResumePoint) -> None:
        """Load everything a checkpoint holds; the model config must match (else HydraCheckpointError).
        A weights-only checkpoint (no loop state) loads the weights and leaves the rest fresh."""
        ck = point.checkpoint
        check_model_config(ck, self.model.config, point.path)
        if "trainer" not in ck:
            # weights only (hydra-model import-hf writes such files): a model to start from, not a
            # run to continue; optimizer, schedule, data order and loop state start fresh
            load_full_state(self.model, self.optimizer, ck["model"], None)
            self.log(f"{point.path.name} holds weights only: training starts from them at step 0")
            return
        load_full_state(self.model, self.optimizer, ck["model"], ck.get("optimizer"))
        for g in self.optimizer.param_groups:  # the current --lr wins over the saved one
            g["initial_lr"] = self.cfg.lr
        if "scheduler" in ck:
            self.schedule.load_state_dict(ck["scheduler"])
        self.load_state_dict(ck["trainer"])
        self.loader.seek(int(ck["data"]["position"]))
        self.callbacks.load_state_dict(ck.get("callbacks", {}), log=self.log)
        restore_rng(ck["rng"])

    def summary(self) -> dict[str, Any]:
        vh = self.state.val_history
        return {
            "run_id": self.run_id,
            "model_id": self.model_id,
            "status": self.status,
            "steps": self.step,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.skipped_steps(),
            "first_val_loss": vh[0][1] if vh else None,
            "final_val_loss": vh[-1][1] if vh else None,
            "best_val_loss": min(v for _, v in vh) if vh else None,
            "final_loss": self.last_log.get("loss"),
            "best_loss": self.state.best_loss,
            "tokens_per_s": (self.step - self._session_start_step) * self.tokens_per_step / self.train_time_s
            if self.train_time_s > 0
            else None,
            "tokens_per_s_last": self.last_log.get("tokens_per_s"),
            "train_time_s": self.train_time_s,
            "memory_mb": self.memory_mb(),
            "stop_reason": self.stop_reason,
        }
