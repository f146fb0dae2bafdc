"""Progress while the race runs, on stderr: a rich bar per configuration on a terminal, plain
timestamped lines with the race's ETA otherwise (logs, pipes, ``nohup``)."""

from __future__ import annotations

import time
from typing import Any

from hydra_kernels.cli_support import err_console


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class RaceProgress:
    """``start(name)``, ``say(msg)`` during setup, ``tick(info)`` from the loop, ``done(result)``."""

    def __init__(self, names: list[str], budget_s: float, enabled: bool = True):
        self.names, self.budget = names, budget_s
        self.enabled = enabled
        self.tty = err_console.is_terminal
        self.t0 = time.perf_counter()
        self.index = -1
        self.setups: list[float] = []
        self.bar = None
        self.task = None
        self.name = ""

    def __enter__(self) -> RaceProgress:
        if self.enabled and self.tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=err_console,
            )
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def _line(self, msg: str) -> None:
        if self.enabled:
            stamp = time.strftime("%H:%M:%S")
            err_console.print(f"[{stamp}] {msg}", highlight=False, markup=False, soft_wrap=True)

    def eta(self, clock: float) -> float:
        """Seconds left in the whole race: this config's budget left, then the others' budgets and
        the mean setup seen so far (evaluation time is small and not counted)."""
        setup = sum(self.setups) / len(self.setups) if self.setups else 0.0
        rest = len(self.names) - self.index - 1
        return max(0.0, self.budget - clock) + rest * (self.budget + setup)

    def start(self, name: str) -> None:
        self.index += 1
        self.name = name
        self._setup_t0 = time.perf_counter()
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=self.budget, info="setup")
        else:
            self._line(f"{name} ({self.index + 1}/{len(self.names)}): setup")

    def say(self, msg: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, info=msg)
        else:  # logs, and on a terminal what comes before the first configuration (the corpus)
            self._line(f"{self.name or 'race'}: {msg}")

    def tick(self, info: dict[str, Any]) -> None:
        clock = info["clock"]
        if len(self.setups) <= self.index:  # the first tick comes when the clock starts
            self.setups.append(time.perf_counter() - self._setup_t0)
        tokens = info.get("tokens", 0)
        rate = tokens / clock if clock > 0 else 0.0
        loss = info.get("loss")
        text = (
            f"{tokens / 1e6:.1f}M tok, {rate / 1e3:.0f}K tok/s, loss {'-' if loss is None else f'{loss:.3f}'}"
        )
        if "eval" in info:
            ev = info["eval"]
            text += f", val {ev['val_loss']:.3f}"
            if ev.get("val_loss_train_mode") is not None:
                text += f" (train-mode {ev['val_loss_train_mode']:.3f})"
        if self.bar is not None:
            self.bar.update(self.task, completed=min(clock, self.budget), info=text)
        else:
            self._line(
                f"{self.name} {clock:.0f}/{self.budget:.0f} s: {text}; race ETA {_hms(self.eta(clock))}"
            )

    def warn(self, msg: str) -> None:
        """Printed even with --quiet: something the reader of the results must know."""
        err_console.print(f"[bold red]warning:[/] {msg}", highlight=False, soft_wrap=True)

    def done(self, result: dict[str, Any]) -> None:
        msg = (
            f"{result['name']}: {result.get('status')}, val {result.get('final_val_loss', float('nan')):.3f} "
            f"after {result.get('tokens', 0) / 1e6:.1f}M tokens (setup {result.get('setup_s', 0):.0f} s)"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=self.budget, info=msg)
        else:
            self._line(msg)
