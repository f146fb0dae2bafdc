"""What a person and the metrics database see while training runs (rank 0 only).

:class:`ProgressCallback` shows a rich progress bar (step, loss, tokens/s, lr, ETA) on a terminal
and one plain line per log interval elsewhere (CI logs, pipes), each ending with the time since
training started and the estimated time left (``elapsed 0:01:05  ETA 0:03:10``), the ETA from the
mean speed of the steps run so far. :class:`MetricsDBCallback` writes
each log interval's rows to ``training.db`` and commits them as one batch, and exports
``diagnostics_{run_id}.json`` at every checkpoint and at the end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hydra_train.callbacks import TrainerCallback
from hydra_train.metrics_db import TrainingDB


def clock_text(seconds: float | None) -> str:
    """``H:MM:SS`` (``-`` when unknown), the format of rich's own elapsed/remaining columns."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = round(max(0.0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


class ProgressCallback(TrainerCallback):
    name = "progress"

    def __init__(
        self,
        console: Console,
        total_steps: int,
        *,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console
        self.clock = clock
        self.t0: float | None = None
        self.step0 = 0
        self.total = total_steps
        self.live = console.is_terminal if live is None else live
        self.progress: Progress | None = None
        self.fields = {"loss": "-", "tps": "-", "lr": "-", "val": "-"}

    def _times(self, step: int) -> str:
        """``elapsed H:MM:SS  ETA H:MM:SS`` for a plain line."""
        if self.t0 is None:
            return ""
        elapsed = self.clock() - self.t0
        done = step - self.step0
        eta = (self.total - step) * elapsed / done if done > 0 else None
        return f"  elapsed {clock_text(elapsed)}  ETA {clock_text(eta)}"

    def on_train_start(self, trainer) -> None:
        self.t0, self.step0 = self.clock(), trainer.step
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s  "
                    "lr {task.fields[lr]}"
                ),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                "train", total=self.total, completed=trainer.step, **self.fields
            )

    def on_step_end(self, step: int, metrics) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.fields.update(
            loss=_fmt(row["loss"], ".4f"), tps=_fmt(row["tokens_per_s"], ",.0f"), lr=_fmt(row["lr"], ".2e")
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=step, **self.fields)
        else:
            skipped = f"  skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
            self.console.print(
                f"step {step:>6}/{self.total}  loss {self.fields['loss']}  "
                f"ema {_fmt(row['ema_short'], '.4f')}  "
                f"{self.fields['tps']} tok/s  lr {self.fields['lr']}  "
                f"gnorm {_fmt(row['grad_norm'], '.3f')}{skipped}{self._times(step)}",
                highlight=False,
                soft_wrap=True,  # one line per interval in a log, whatever the width
            )

    def on_eval(self, step: int, val_loss: float) -> None:
        self.fields["val"] = _fmt(val_loss, ".4f")
        if self.progress is not None:
            self.progress.update(self.task, **self.fields)
        else:
            self.console.print(
                f"step {step:>6}/{self.total}  validation loss {self.fields['val']}{self._times(step)}",
                highlight=False,
                soft_wrap=True,
            )

    def on_train_end(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class MetricsDBCallback(TrainerCallback):
    """Rows to ``training.db`` at each log interval (one commit per interval); JSON export on save/end."""

    name = "metrics_db"

    def __init__(
        self, db: TrainingDB, run_id: str, export_dir: str | Path, *, announce_commits: bool = False
    ):
        self.db = db
        self.run_id = run_id
        self.export_path = Path(export_dir) / f"diagnostics_{run_id}.json"
        self.announce = announce_commits  # tests read these lines to know what is durable

    def on_train_start(self, trainer) -> None:
        self.trainer = trainer

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.db.log_step(
            self.run_id,
            step,
            time=row["time"],
            loss=row["loss"],
            ce_loss=row["ce_loss"],
            aux_loss=row["aux_loss"],
            aux=row["aux"],
            lr=row["lr"],
            grad_norm=row["grad_norm"],
            tokens_per_s=row["tokens_per_s"],
            tokens_seen=row["tokens_seen"],
            memory_mb=row["memory_mb"],
            skipped_steps=row["skipped_steps"],
            ema_short=row["ema_short"],
            ema_medium=row["ema_medium"],
            ema_long=row["ema_long"],
        )
        self.db.log_lr(self.run_id, step, row["lr"], row["base_lr"], row["lr_phase"])
        stats = routing_stats_python(self.trainer.model)
        if stats:
            self.db.log_routing(self.run_id, step, stats)
        self.db.commit()
        if self.announce:
            print(f"[metrics_db] committed step {step}", flush=True)

    def on_eval(self, step: int, val_loss: float) -> None:
        self.db.log_eval(self.run_id, step, val_loss)
        self.db.commit()

    def export(self) -> Path:
        return self.db.export_run(self.run_id, self.export_path)

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self.db.finish_run(
            self.run_id,
            summary["status"],
            end_step=summary["steps"],
            best_loss=summary.get("best_loss"),
            best_val_loss=summary.get("best_val_loss"),
            final_val_loss=summary.get("final_val_loss"),
            tokens_per_s=summary.get("tokens_per_s"),
        )
        self.export()


def routing_stats_python(model) -> dict[str, Any] | None:
    """``routing_stats_to_python(model.routing_stats())``, or None for a model without routing stats."""
    fn = getattr(model, "routing_stats", None)
    if fn is None:
        return None
    stats = fn()
    if not stats:
        return None
    from hydra_model import routing_stats_to_python

    return routing_stats_to_python(stats)
