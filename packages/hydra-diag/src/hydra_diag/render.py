"""Rich tables for people: one generic row table and a key/value table, used by every command.

Renderers take the same JSON-able result dict that ``--json`` prints, so a table can be rebuilt
from a saved result later (the GPU suite does that at its end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _plain(value: Any, spec: str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return format(value, spec) if spec else f"{value:.4g}"
    if isinstance(value, int) and spec:
        return format(value, spec)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v, spec) for v in value) + "]"
    return str(value)


def fmt(value: Any, spec: str | None = None) -> str:
    """A cell: ``-`` for missing values, floats with 4 significant digits unless ``spec`` says.
    Escaped: kernel names and labels like ``sdpa[flash_attention]`` are text, not rich markup."""
    return escape(_plain(value, spec))


def rows_table(
    title: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    formats: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    styles: Iterable[str | None] | None = None,
) -> Table:
    """A table with one row per dict; ``columns`` picks and orders keys (default: the first row's)."""
    formats = formats or {}
    headers = headers or {}
    columns = list(columns or (rows[0].keys() if rows else []))
    t = Table(title=escape(title), title_justify="left")
    for c in columns:
        numeric = any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
        t.add_column(escape(headers.get(c, c)), justify="right" if numeric else "left")
    style_list = list(styles) if styles is not None else [None] * len(rows)
    for r, style in zip(rows, style_list, strict=False):
        t.add_row(*(fmt(r.get(c), formats.get(c)) for c in columns), style=style)
    return t


def kv_table(title: str, items: dict[str, Any], formats: dict[str, str] | None = None) -> Table:
    """Two columns: name and value."""
    formats = formats or {}
    t = Table(title=escape(title), title_justify="left", show_header=False, min_width=min(len(title), 100))
    t.add_column(style="bold")
    t.add_column()
    for k, v in items.items():
        t.add_row(k, fmt(v, formats.get(k)))
    return t


def verdict_style(passed: bool | None) -> str | None:
    """Row style for a check: red when it failed, nothing otherwise."""
    return "red" if passed is False else None


def print_checks(console: Console, title: str, checks: Sequence[dict[str, Any]]) -> None:
    """Checks as rows ``name | passed | value | expected | detail`` with failures in red."""
    console.print(
        rows_table(
            title,
            checks,
            ["name", "passed", "value", "expected", "detail"],
            styles=[verdict_style(c.get("passed")) for c in checks],
        )
    )


def print_findings(console: Console, findings: Sequence[dict[str, Any]], title: str = "findings") -> None:
    """Findings (``severity``, ``kind``, ``message``) or a line saying there are none."""
    if not findings:
        console.print(f"[green]{title}: none[/]")
        return
    sev_style = {"error": "red", "warning": "yellow"}
    console.print(
        rows_table(
            title,
            findings,
            [c for c in ("severity", "kind", "layer", "step", "message") if any(c in f for f in findings)],
            styles=[sev_style.get(f.get("severity", "")) for f in findings],
        )
    )
