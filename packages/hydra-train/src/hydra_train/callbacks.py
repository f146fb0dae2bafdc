"""Callbacks: how code outside the loop (SafeOptimizations, TensorBoard, W&B, tests) joins in.

A callback subclasses :class:`TrainerCallback` and overrides what it needs:

``on_train_start(trainer)``          before the first step (after a resume has been applied)
``on_after_backward(step, model)``   after the backward of the eager step, before the finiteness
                                     check and the optimizer (fault injection, gradient probes);
                                     not called in the steps a CUDA graph runs (the capture step
                                     included: host code cannot be replayed)
``on_graph_failure(step, reason)``   the trainer's CUDA graph could not be captured or replayed and
                                     was dropped; the step ran (or runs) eagerly
``on_step_end(step, metrics)``       after every optimizer step, applied or skipped
``on_log(step, row)``                at log intervals, with the floats written to the database
``on_eval(step, val_loss)``          after each validation pass
``on_train_end(summary)``            once, with the run summary (also after a failure: status says)
``state_dict()/load_state_dict()``   saved in checkpoints under ``"callbacks"[name]``, restored on resume

:class:`StepMetrics` holds device tensors. Reading one (``float(metrics.loss)``,
:meth:`StepMetrics.as_floats`) waits for the GPU; a callback that needs a float every step
therefore costs a host sync every step, which is its choice, not the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer


@dataclass
class StepMetrics:
    """One optimizer step. Tensors are 0-d on the training device."""

    step: int  # optimizer steps done after this one (1 for the first step)
    loss: torch.Tensor  # mean over the micro-batches of what was backpropagated
    ce_loss: torch.Tensor
    aux_losses: dict[str, torch.Tensor]
    grad_norm: torch.Tensor  # total norm before clipping; non-finite when a gradient was
    finite: torch.Tensor  # bool: True when the step was applied
    lr: float
    tokens: int  # tokens in this step, all ranks
    tokens_per_s: float  # host wall clock since the previous step ended (synced only at log steps)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_floats(self) -> dict[str, Any]:
        """Everything as Python numbers (syncs with the device once)."""
        names = ["loss", "ce_loss", "grad_norm"]
        aux_names = sorted(self.aux_losses)
        vals = torch.stack(
            [getattr(self, n).float() for n in names]
            + [self.aux_losses[n].float() for n in aux_names]
            + [self.finite.float()]
        ).tolist()
        out: dict[str, Any] = dict(zip(names, vals[: len(names)], strict=True))
        out["aux"] = dict(zip(aux_names, vals[len(names) : -1], strict=True))
        out["finite"] = bool(vals[-1])
        out.update(step=self.step, lr=self.lr, tokens=self.tokens, tokens_per_s=self.tokens_per_s)
        return out


class TrainerCallback:
    """Base class with no-op hooks. ``name`` keys the callback's state in checkpoints."""

    name: str = "callback"

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_after_backward(self, step: int, model: torch.nn.Module) -> None:
        pass

    def on_graph_failure(self, step: int, reason: str) -> None:
        pass

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        pass

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        pass

    def on_eval(self, step: int, val_loss: float) -> None:
        pass

    def on_train_end(self, summary: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class CallbackList:
    """Calls every callback in order; names must be unique (they key checkpoint state)."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add(cb)

    def add(self, cb: TrainerCallback) -> None:
        if any(c.name == cb.name for c in self.callbacks):
            raise ValueError(f"a callback named {cb.name!r} is already registered")
        self.callbacks.append(cb)

    def remove(self, cb: TrainerCallback) -> None:
        self.callbacks.remove(cb)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {cb.name: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict[str, dict[str, Any]], log=print) -> None:
        for cb in self.callbacks:
            if cb.name in state:
                cb.load_state_dict(state[cb.name])
        unknown = sorted(set(state) - {cb.name for cb in self.callbacks})
        if unknown:
            log(f"checkpoint has state for callbacks not active in this run: {', '.join(unknown)}")


class TensorBoardCallback(TrainerCallback):
    """``--tensorboard``: scalars to ``<run folder>/tensorboard``."""

    name = "tensorboard"

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from hydra_train.errors import HydraTrainError

            raise HydraTrainError(
                "--tensorboard needs the tensorboard package: pip install 'hydra-train[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=log_dir)

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                self.writer.add_scalar(f"train/{k}", v, step)
        for k, v in (row.get("aux") or {}).items():
            self.writer.add_scalar(f"aux/{k}", v, step)

    def on_eval(self, step: int, val_loss: float) -> None:
        self.writer.add_scalar("val/loss", val_loss, step)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self.writer.close()


class WandbCallback(TrainerCallback):
    """``--wandb``: offline unless ``WANDB_MODE`` says otherwise (files under the run folder)."""

    name = "wandb"

    def __init__(self, run_dir: str, run_id: str, config: dict[str, Any]):
        import os

        try:
            import wandb
        except ImportError:
            from hydra_train.errors import HydraTrainError

            raise HydraTrainError(
                "--wandb needs the wandb package: pip install 'hydra-train[wandb]'"
            ) from None
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "hydra"),
            name=run_id,
            dir=run_dir,
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        flat = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        flat.update({f"aux/{k}": v for k, v in (row.get("aux") or {}).items()})
        self.run.log(flat, step=step)

    def on_eval(self, step: int, val_loss: float) -> None:
        self.run.log({"val/loss": val_loss}, step=step)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self.run.finish()
