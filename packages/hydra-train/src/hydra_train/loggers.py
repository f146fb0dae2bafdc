"""Loggers: where a run's numbers go besides the metrics database. One place to add one.

A logger is a :class:`Logger` subclass (a :class:`hydra_train.callbacks.TrainerCallback` that
writes in ``log_row``/``log_eval``/``close``) decorated with :func:`register_logger` here. Its
``name`` is its flag (``--tensorboard``), its ``help`` the flag's help; ``for_run(run_dir, run_id,
config)`` builds it for a run. The flag becomes a boolean field of the configuration's runtime
section (:mod:`hydra_train.config_options`) and an option of ``hydra-train run``;
:mod:`hydra_train.run` adds every logger whose flag is set (rank 0 only).

The classes import their library (tensorboard, wandb) only when built, so this module stays light:
the configuration reads the registry while ``--help`` runs. A missing library stops the run with
one line before anything is built (:func:`check_logger_packages`), a backend that cannot start
when the logger is built. A backend that fails later (a
full disk, a dropped connection) does not end the run: a :class:`Logger` turns itself off with one
warning line on stderr, and the summary reports it (``logger_errors``, the table's ``loggers`` row);
training.db and its exports still get every row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra_train.callbacks import TrainerCallback

#: flag name -> logger class, in registration order
LOGGERS: dict[str, type[TrainerCallback]] = {}


def register_logger(cls: type[TrainerCallback]) -> type[TrainerCallback]:
    """Register ``cls`` (a TrainerCallback with ``name``, ``help`` and ``for_run``) as a logger."""
    if cls.name in LOGGERS:
        raise ValueError(f"a logger with the flag --{cls.name} is already registered")
    LOGGERS[cls.name] = cls
    return cls


def import_backend(name: str, load: Callable[[], Any]) -> Any:
    """What the logger ``--name``'s ``load`` imports (its library), or a HydraTrainError saying
    what to install."""
    from hydra_train.errors import HydraTrainError

    try:
        return load()
    except ImportError:
        what = f"--{name} needs the {name} package"
        raise HydraTrainError(f"{what}: pip install 'hydra-train[{name}]'") from None


def check_logger_packages(cfg: Any) -> None:
    """A HydraTrainError naming the first switched-on logger whose package is missing, checked
    before anything is built: found when the loggers are built, it came after the data loading (a
    minute on a cold corpus cache) and left an empty run folder behind."""
    for name, cls in LOGGERS.items():
        if getattr(cfg, name, False) and hasattr(cls, "load"):
            import_backend(name, cls.load)


def build_loggers(cfg: Any, run_dir: Path, run_id: str) -> list[TrainerCallback]:
    """The loggers ``cfg`` switches on, built for this run."""
    return [
        cls.for_run(run_dir, run_id, cfg.to_dict()) for name, cls in LOGGERS.items() if getattr(cfg, name)
    ]


class Logger(TrainerCallback):
    """Base of the loggers: subclasses write in :meth:`log_row`, :meth:`log_eval` and :meth:`close`;
    the hooks call them and turn the logger off at its first failure (see the module docstring)."""

    #: why the logger went off (``failed at step N (...)``), None while it works
    error: str | None = None

    def log_row(self, step: int, row: dict[str, Any]) -> None:
        pass

    def log_eval(self, step: int, val_loss: float) -> None:
        pass

    def close(self) -> None:
        pass

    def _guarded(self, step: int | None, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
            if self.error is None:
                self.error = f"failed at step {step} ({what}); off from then on"
                print(
                    f"warning: the --{self.name} logger failed at step {step} ({what}); it is off "
                    "for the rest of the run (training.db still gets every row)",
                    file=sys.stderr,
                    flush=True,
                )

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        if self.error is None:
            self._guarded(step, self.log_row, step, row)

    def on_eval(self, step: int, val_loss: float) -> None:
        if self.error is None:
            self._guarded(step, self.log_eval, step, val_loss)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self._guarded(summary.get("steps"), self.close)  # also after a failure: keeps what was written
        if self.error is not None:
            summary.setdefault("logger_errors", {})[self.name] = self.error


@register_logger
class TensorBoardCallback(Logger):
    """``--tensorboard``: scalars to ``<run folder>/tensorboard``."""

    name = "tensorboard"
    help = "Also log scalars to TensorBoard (run folder)."

    @staticmethod
    def load() -> Any:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        return SummaryWriter

    @classmethod
    def for_run(cls, run_dir: Path, run_id: str, config: dict[str, Any]) -> TensorBoardCallback:
        return cls(str(run_dir / "tensorboard"))

    def __init__(self, log_dir: str):
        self.writer = import_backend(self.name, self.load)(log_dir=log_dir)

    def log_row(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                self.writer.add_scalar(f"train/{k}", v, step)
        for k, v in (row.get("aux") or {}).items():
            self.writer.add_scalar(f"aux/{k}", v, step)

    def log_eval(self, step: int, val_loss: float) -> None:
        self.writer.add_scalar("val/loss", val_loss, step)

    def close(self) -> None:
        self.writer.close()


@register_logger
class WandbCallback(Logger):
    """``--wandb``: offline unless ``WANDB_MODE`` says otherwise (files under the run folder)."""

    name = "wandb"
    help = "Also log to Weights & Biases (offline unless WANDB_MODE says otherwise)."

    @staticmethod
    def load() -> Any:
        import wandb

        return wandb

    @classmethod
    def for_run(cls, run_dir: Path, run_id: str, config: dict[str, Any]) -> WandbCallback:
        return cls(str(run_dir), run_id, config)

    def __init__(self, run_dir: str, run_id: str, config: dict[str, Any]):
        from hydra_train.options import train_options

        self.wandb = wandb = import_backend(self.name, self.load)
        opts = train_options()
        try:
            self.run = wandb.init(
                project=opts.wandb_project,
                name=run_id,
                dir=run_dir,
                config=config,
                mode=opts.wandb_mode,
            )
        except Exception as exc:
            from hydra_train.errors import HydraTrainError

            raise HydraTrainError(
                f"--wandb: wandb.init failed ({type(exc).__name__}: {exc}) with WANDB_MODE="
                f"{opts.wandb_mode}; unset WANDB_MODE (offline: no network) or fix the W&B setup"
            ) from None

    def log_row(self, step: int, row: dict[str, Any]) -> None:
        flat = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        flat.update({f"aux/{k}": v for k, v in (row.get("aux") or {}).items()})
        self.run.log(flat, step=step)

    def log_eval(self, step: int, val_loss: float) -> None:
        self.run.log({"val/loss": val_loss}, step=step)

    def close(self) -> None:
        self.run.finish()
