"""The race's tables, readable at 80 columns: one row per configuration in each.

1. the run: parameters, executed GFLOP per token (forward + backward; "GF/tok"), tokens/s, setup
   seconds, tokens seen, epochs over the training split (and a status column when one failed);
2. validation loss (inference-mode routing) at each evaluation time, then the final figure with
   training-mode routing (routed models only).
"""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.table import Table


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _si(x: float | None) -> str:
    if x is None:
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _secs(x: float) -> str:
    """Seconds to one decimal, no trailing zeros: a 5 s budget's 1.5, 2 and 2.5 s marks must not all
    read "2" (whole seconds did), while a 120 s budget's read 20, 40 ..."""
    return f"{round(x, 1):g}"


def _table(title: str) -> Table:
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
        min_width=len(title),  # a narrow table (few evaluations) must not wrap its title
    )


def _name_column(t: Table, runs: list[dict[str, Any]]) -> None:
    width = max((len(r["name"]) for r in runs), default=6)
    t.add_column("config", no_wrap=True, min_width=width)


def run_table(doc: dict[str, Any]) -> Table:
    runs = doc["runs"]
    t = _table("race: the runs (same tokens, same order, same optimizer)")
    _name_column(t, runs)
    show_status = any(r.get("status") != "ok" for r in runs)
    cols = ("params", "GF/tok", "tok/s", "setup s", "tokens", "epochs") + (("status",) if show_status else ())
    for col in cols:
        t.add_column(col, justify="left" if col == "status" else "right")
    for r in runs:
        cells = [
            r["name"],
            _si(r.get("params")),
            _f(r["flops_per_token"] / 1e9 if r.get("flops_per_token") else None, ".3g"),
            _si(r.get("tokens_per_s")),
            _f(r.get("setup_s"), ".0f"),
            _si(r.get("tokens")),
            _f(r.get("epochs"), ".2f"),
        ]
        t.add_row(*cells, *([r.get("status", "-")] if show_status else []))
    return t


def loss_table(doc: dict[str, Any]) -> Table:
    runs = doc["runs"]
    budget = doc["settings"]["budget_s"]
    n = doc["settings"]["evals"]
    t = _table("validation CE at training time (eval-mode routing)")
    _name_column(t, runs)
    for i in range(1, n + 1):
        t.add_column(f"{_secs(budget * i / n)}s", justify="right")
    t.add_column("train-mode", justify="right")
    # finite losses only: a diverged run's NaN (in a live run's document) compares false with
    # everything, and min() would return it whenever it came first
    finals = [r.get("final_val_loss") for r in runs]
    best = min((x for x in finals if x is not None and math.isfinite(x)), default=None)
    for r in runs:
        cells = [_f(e.get("val_loss"), ".3f") for e in r.get("evals", [])[1:]]
        cells += ["-"] * (n - len(cells))
        if best is not None and r.get("final_val_loss") == best:
            cells[-1] = f"[bold]{cells[-1]}[/]"
        t.add_row(r["name"], *cells, _f(r.get("final_val_loss_train_mode"), ".3f"))
    return t


def header_lines(doc: dict[str, Any]) -> list[str]:
    s, d, e = doc["settings"], doc["data"], doc["environment"]
    val_windows = d.get("val_windows_used", s["val_windows"])  # the split may hold fewer than asked
    return [
        f"data: {d.get('description')}",
        f"{s['model_size']}, {_secs(s['budget_s'])} s of training each, "
        f"batch {s['batch_size']}x{s['seq_len']}, {val_windows} val windows, seed {s['seed']}",
        f"device: {e.get('device_name')}, torch {e.get('torch')}, triton {e.get('triton')}, {e.get('date')}",
    ]


def render_race(doc: dict[str, Any], console) -> None:
    for line in header_lines(doc):
        console.print(line, highlight=False, markup=False)
    console.print(run_table(doc))
    console.print(loss_table(doc))
    over = [r["name"] for r in doc["runs"] if (r.get("epochs") or 0) > 1]
    if over:
        console.print(
            f"[bold red]warning:[/] {', '.join(over)} went over the training split more than once "
            "(repeated tokens): use a larger corpus (--extensions) or a shorter budget",
            highlight=False,
        )
