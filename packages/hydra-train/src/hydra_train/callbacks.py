"""Callbacks: how code outside the loop (SafeOptimizations, loggers, tests) joins in.

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
``on_train_end(summary)``            once, with the run summary (also after a failure: status says);
                                     every callback gets it even when one before it raises
                                     (the metrics database closes the run), then the first
                                     error is raised
``state_dict()/load_state_dict()``   saved in checkpoints under ``"callbacks"[name]``, restored on resume

Loggers (TensorBoard, W&B) are callbacks registered with their flag in :mod:`hydra_train.loggers`.
No torch import at module level: the configuration (and ``--help``) reads the logger registry.

:class:`StepMetrics` holds device tensors. Reading one (``float(metrics.loss)``,
:meth:`StepMetrics.as_floats`) waits for the GPU; a callback that needs a float every step
therefore costs a host sync every step, which is its choice, not the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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
        import torch

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
        """Call ``hook`` on every callback in order. An exception stops the others, except in
        ``on_train_end``: the run's teardown, which every callback gets (the metrics database
        records the run's end, the artifacts close); the first exception is raised after."""
        if hook != "on_train_end":
            for cb in self.callbacks:
                getattr(cb, hook)(*args)
            return
        first: BaseException | None = None
        for cb in self.callbacks:
            try:
                getattr(cb, hook)(*args)
            except BaseException as exc:  # raised again below, once every callback has run
                if first is None:
                    first = exc
                    if hasattr(exc, "add_note"):  # Python 3.11+: the traceback names the callback
                        exc.add_note(f"raised by callback {cb.name!r} in on_train_end")
        if first is not None:
            raise first

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {cb.name: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict[str, dict[str, Any]], log=print) -> None:
        for cb in self.callbacks:
            if cb.name in state:
                cb.load_state_dict(state[cb.name])
        unknown = sorted(set(state) - {cb.name for cb in self.callbacks})
        if unknown:
            log(f"checkpoint has state for callbacks not active in this run: {', '.join(unknown)}")


def __getattr__(name: str):
    # the loggers moved to hydra_train.loggers (their registry); importable from here as before
    if name in ("TensorBoardCallback", "WandbCallback"):
        from hydra_train import loggers

        return getattr(loggers, name)
    raise AttributeError(f"module 'hydra_train.callbacks' has no attribute {name!r}")
