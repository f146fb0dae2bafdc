"""What the loop remembers: step and token counts, validation history, the loss EMAs and skipped
steps (on the device, read at log points), and how all of it goes into and out of a checkpoint.

The state half of :class:`hydra_train.trainer.Trainer`, which sets every attribute used here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hydra_train.checkpoint import (
    FORMAT,
    VERSION,
    ResumePoint,
    capture_rng,
    check_model_config,
    restore_rng,
    resume_data_position,
)
from hydra_train.distributed import (
    fail_together,
    full_model_state,
    full_optimizer_state,
    is_fsdp,
    load_full_state,
)
from hydra_train.errors import HydraDivergedError
from hydra_train.safe_opts.adam8bit import adamw_state_dict_from_8bit, is_8bit_state_dict

EMA_ALPHAS = (0.99, 0.999, 0.9999)


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done (applied or skipped)
    tokens_seen: int = 0
    val_history: list[tuple[int, float]] = field(default_factory=list)
    best_loss: float = math.inf


class TrainerStateMixin:
    """Loss EMAs, skip counting, checkpoint payload, resume and the run summary."""

    def _init_state(self, device: torch.device) -> None:
        self.state = LoopState()
        #: the data's fingerprint (hydra_train.data_fingerprint), set by the runner: saved in every
        #: checkpoint and compared on resume; None (a Trainer built by hand): neither
        self.data_fingerprint: dict[str, Any] | None = None
        self._alphas = torch.tensor(EMA_ALPHAS, dtype=torch.float64, device=device)
        self._ema = torch.zeros(3, dtype=torch.float64, device=device)
        self._ema_count = torch.zeros((), dtype=torch.float64, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        # skipped steps in a row ending at the current step (on the device: read at log/save points)
        self._streak = torch.zeros((), dtype=torch.int64, device=device)
        # the longest streak seen and the step it reached: the check runs at log and save points
        # only, and a streak that ended between two of them would otherwise go unseen
        self._worst_streak = torch.zeros((), dtype=torch.int64, device=device)
        self._worst_end = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def step(self) -> int:
        return self.state.step

    def _update_ema(self, loss: torch.Tensor, finite: torch.Tensor) -> None:
        f = finite.to(torch.float64)
        new = self._ema * self._alphas + (1 - self._alphas) * torch.nan_to_num(loss.double())
        self._ema = torch.where(finite, new, self._ema)
        self._ema_count = self._ema_count + f
        self._skipped = self._skipped + (~finite).to(torch.int64)
        self._streak = torch.where(finite, torch.zeros_like(self._streak), self._streak + 1)
        longer = self._streak > self._worst_streak
        self._worst_streak = torch.where(longer, self._streak, self._worst_streak)
        self._worst_end = self._worst_end.masked_fill(longer, self.step)

    def check_skip_streak(self) -> None:
        """Stop (:class:`HydraDivergedError`) once more than ``--max_skipped_steps`` optimizer steps in
        a row were skipped for non-finite loss or gradients, the current streak or one that ended
        since the last check (one host sync)."""
        streak, end = torch.stack([self._worst_streak, self._worst_end]).tolist()
        if streak > self.cfg.optim.max_skipped_steps:
            first = end - streak + 1
            raise HydraDivergedError(
                f"training diverged: {streak} steps in a row ({first}-{end}) had non-finite "
                f"loss or gradients (limit --max_skipped_steps {self.cfg.optim.max_skipped_steps}); stopped "
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
            # a resumed run stops at the same step of a skip streak as the uninterrupted one would
            "streak": self._streak.cpu(),
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
        streak = s.get("streak")  # absent in older checkpoints: no streak carried over
        self._streak = (
            streak.to(self.device, torch.int64)
            if streak is not None
            else torch.zeros((), dtype=torch.int64, device=self.device)
        )

    def checkpoint_payload(self, model_config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint dict (collective under FSDP: every rank must call it)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "time": time.time(),
            "run_id": self.run_id,
            "model_id": self.model_id,
            "model_size": self.cfg.model.model_size,
            "model": full_model_state(self.model),
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.schedule.state_dict(),
            "rng": capture_rng(),
            # what the position means beyond the train config (batch size, seq_len): the world size;
            # a resume with other values converts it or refuses (checkpoint.resume_data_position)
            "data": {
                "position": self.loader.position,
                "seed": self.cfg.runtime.seed,
                "world_size": self.dist.world_size,
                # the window layout the position counts in: a resume on other data is refused
                **({"fingerprint": self.data_fingerprint} if self.data_fingerprint is not None else {}),
            },
            "trainer": self.state_dict(),
            "config": {"model": model_config, "train": self.cfg.to_dict()},
            "callbacks": self.callbacks.state_dict(),
        }

    def save_checkpoint(self, final: bool = False) -> Path | None:
        """Write a step (or the final) checkpoint through ``self.saver`` (set by the runner)."""
        return self.saver(self, final) if self.saver is not None else None

    @staticmethod
    def reset_graph_state(optimizer: torch.optim.Optimizer) -> None:
        """Undo what a CUDA graph left in saved optimizer state: its lr tensor (loaded on the CPU,
        where a new capture would read it once and never again) and capturable mode. A new
        capture, if any, sets both again on this run's device."""
        for g in optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"] = float(g["lr"])
            if "capturable" in g:
                g["capturable"] = False

    def resume_from(self, point: ResumePoint) -> None:
        """Load everything a checkpoint holds; the model config must match and the data settings
        must allow continuing the data stream (else HydraCheckpointError). A weights-only
        checkpoint (no loop state) loads the weights and leaves the rest fresh.

        Under torchrun every rank calls it, and what a rank does alone is shared (the lowest
        failing rank's error raised on every rank: distributed.fail_together says why): the
        checks (each rank compares its own data with the checkpoint's) and the restoring after the
        weights (rank 0 alone has the database's and the loggers' callbacks). FSDP's loading
        stays outside: it scatters every tensor from rank 0 (``distribute_tensor``), and a rank
        that left its order to share a failure would meet the others' scatter with its
        all-gather. DDP's and one process's loading are local, so they go with the checks."""
        ck, fsdp = point.checkpoint, is_fsdp(self.model)
        loop = "trainer" in ck  # else weights only (hydra-model import-hf writes such files)
        with fail_together(self.dist):
            check_model_config(ck, self.model.config, point.path)
            position, notes, optim_state = 0, [], None
            if loop:
                position, notes = resume_data_position(
                    ck, self.cfg, self.dist.world_size, point.path, self.data_fingerprint
                )
                optim_state = self._optimizer_state_of(ck, point.path, notes)
            if not fsdp:
                load_full_state(self.model, self.optimizer, ck["model"], optim_state)
        if fsdp:
            load_full_state(self.model, self.optimizer, ck["model"], optim_state)
        if not loop:
            # a model to start from, not a run to continue; optimizer, schedule, data order and
            # loop state start fresh
            self.log(f"{point.path.name} holds weights only: training starts from them at step 0")
            return
        with fail_together(self.dist):
            for g in self.optimizer.param_groups:  # the current --lr wins over the saved one
                g["initial_lr"] = self.cfg.optim.lr
            self.reset_graph_state(self.optimizer)
            if "scheduler" in ck:
                self.schedule.load_state_dict(ck["scheduler"])
            self.load_state_dict(ck["trainer"])
            self.loader.seek(position)
            for note in notes:
                self.log(note)
            self.callbacks.load_state_dict(ck.get("callbacks", {}), log=self.log)
            restore_rng(ck["rng"])

    def _optimizer_state_of(self, ck: dict[str, Any], path: Path, notes: list[str]) -> dict[str, Any] | None:
        """The optimizer state to load from ``ck``, an older --8bit_adam one converted (a note added)."""
        optim_state = ck.get("optimizer")
        if optim_state is not None and is_8bit_state_dict(optim_state):
            # run built bitsandbytes' AdamW8bit itself for a while: torch's AdamW took that state
            # and failed at its first step (no exp_avg); converted, it continues from its moments
            optim_state, n = adamw_state_dict_from_8bit(optim_state, self.optimizer)
            notes.append(
                f"{path.name}: bitsandbytes AdamW8bit state (an older --8bit_adam checkpoint) "
                f"converted to AdamW's for {n} parameters"
            )
        return optim_state

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
            # the steps train_time_s timed: up to the last log row (a failure after it ran steps
            # that no interval timed, and counting them overstated the speed)
            "tokens_per_s": (self.last_log["step"] - self._session_start_step)
            * self.tokens_per_step
            / self.train_time_s
            if self.train_time_s > 0 and "step" in self.last_log
            else None,
            "tokens_per_s_last": self.last_log.get("tokens_per_s"),
            "train_time_s": self.train_time_s,
            "memory_mb": self.memory_mb(),
            "stop_reason": self.stop_reason,
        }
