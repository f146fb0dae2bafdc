"""Output that stays readable at 80 columns: ``--help`` option panels and record tables.

Typer's rich help puts each option's spellings in a cell joined by commas without spaces
(``--model-size,--model_size``) and the ``--no-`` forms in a column of their own; at 80 columns
rich then cuts both with an ellipsis (``--model-size,--mo…``). :func:`patch_typer_help` replaces
the options panel with one whose first cell lists every spelling separated by ", " (so it wraps
between spellings, never inside one) and no separate ``--no-`` column. It touches a private part
of Typer; when that part is missing (another Typer version) the stock panel stays.

:func:`print_records` prints rows of numbers as a table when it fits the console and otherwise
as one field/value block per record, so that no number is ever shortened to ``287…``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

_patched = False
#: What the panel asks of an option: a Typer that vendors its own click (0.27) has neither, and
#: every --help raised AttributeError with the panel patched in; such a Typer keeps its own panel.
OPTION_API = ("display_type_rich", "_get_number_range_help_str")


def _options_panel(*, name: str, params: list, ctx: Any, markup_mode: Any, console: Console) -> None:
    import typer.rich_utils as ru
    from rich import box
    from rich.panel import Panel

    rows = []
    for param in params:
        is_argument = isinstance(param, ru.TyperArgument)
        if is_argument:
            label = param.display_name_raw + ("..." if param.metavar is None and param.nargs != 1 else "")
            names = Text(label, style=ru.STYLE_OPTION)
        else:
            names = Text(overflow="fold")
            # long spellings first, then short ones (-h), then the --no- forms: a fixed order whatever
            # spelling the user typed
            opts = sorted(param.opts, key=lambda o: not o.startswith("--"))
            spellings = [*opts, *param.secondary_opts]
            for i, s in enumerate(spellings):
                style = ru.STYLE_NEGATIVE_OPTION if s in param.secondary_opts else ru.STYLE_OPTION
                names.append((", " if i else "") + s, style=style)
        shown = None if getattr(param, "is_flag", False) else param.display_type_rich(ctx=ctx)
        span = param._get_number_range_help_str()
        if shown is not None or span:
            # the type (or the choices, a|b|c) after the names, wrapping onto its own line when needed
            names.append(
                " " + (shown or "") + (ru.RANGE_STRING.format(span) if span else ""), style=ru.STYLE_TYPES
            )
        required = Text(ru.REQUIRED_SHORT_STRING, style=ru.STYLE_REQUIRED_SHORT) if param.required else ""
        help_cell = ru._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode)
        for item in getattr(help_cell, "renderables", []):  # long words (module names) fold, not cut
            if isinstance(item, Text):
                item.overflow = "fold"
        rows.append([required, names, help_cell])
    if not rows:
        return
    table = Table(
        show_header=False,
        expand=True,
        box=getattr(box, ru.STYLE_OPTIONS_TABLE_BOX, None),
        show_lines=ru.STYLE_OPTIONS_TABLE_SHOW_LINES,
        leading=ru.STYLE_OPTIONS_TABLE_LEADING,
        border_style=ru.STYLE_OPTIONS_TABLE_BORDER_STYLE,
        row_styles=ru.STYLE_OPTIONS_TABLE_ROW_STYLES,
        pad_edge=ru.STYLE_OPTIONS_TABLE_PAD_EDGE,
        padding=ru.STYLE_OPTIONS_TABLE_PADDING,
    )
    with_required = any(r[0] for r in rows)
    if with_required:
        table.add_column(width=1, no_wrap=True)
    # the names column is as wide as the longest single spelling (+ its comma), at most 42 columns,
    # so that a spelling is never split and the help keeps at least ~30 columns at 80
    longest = max((len(w) + 1 for r in rows for w in r[1].plain.split()), default=10)
    table.add_column(width=min(longest, 42), overflow="fold")
    table.add_column(overflow="fold")
    for r in rows:
        table.add_row(*(r if with_required else r[1:]))
    console.print(
        Panel(
            table, border_style=ru.STYLE_OPTIONS_PANEL_BORDER, title=name, title_align=ru.ALIGN_OPTIONS_PANEL
        )
    )


def patch_typer_help() -> None:
    """Make every Typer app's options panel list all spellings without truncation (idempotent)."""
    global _patched
    if _patched:
        return
    try:
        import typer.rich_utils as ru
        from typer.core import TyperOption

        needed = ("_print_options_panel", "_get_parameter_help", "TyperArgument", "STYLE_OPTION")
        if all(hasattr(ru, n) for n in needed) and all(hasattr(TyperOption, n) for n in OPTION_API):
            ru._print_options_panel = _options_panel
    except ImportError:  # typer without rich: click's plain help, which never truncates
        pass
    _patched = True


def compact_table(title: str, first: str, columns: Sequence[str], fold: Sequence[str] | None = None) -> Table:
    """A table for 80 columns (a terminal's default, and a log file's): a rule under the header
    only, no borders between columns. The first column (a name: an op, a case) and every column
    not in ``fold`` (default: the last one, free text such as an error) keep their cells whole;
    the ``fold`` columns wrap. rich's boxed default cut every column at 80, op names to
    ``ccgqa_co…``, and folding every column split short words such as ``reference``."""
    from rich import box

    fold = (columns[-1],) if fold is None else tuple(fold)
    # two spaces between columns (a right pad and the box's blank separator), none at the edges
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    t.add_column(first, no_wrap=True)
    for c in columns:
        if c in fold:
            t.add_column(c, overflow="fold")
        else:
            t.add_column(c, no_wrap=True)
    return t


def format_cell(value: Any) -> str:
    """``-`` for missing, 4 significant digits for floats, the value itself otherwise."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_records(
    console: Console,
    title: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    fmt: Callable[[Any], str] = format_cell,
) -> None:
    """``rows`` as one table when every cell fits ``console.width`` whole, else one two-column
    block (field, value) per record. Numbers are right-aligned; nothing is ever cut."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    numeric = [bool(rows) and isinstance(rows[0].get(c), (int, float)) for c in columns]
    # each column: its widest cell or header, plus one space of padding each side and a border
    needed = 1 + sum(max([len(c), *(len(row[i]) for row in cells)]) + 3 for i, c in enumerate(columns))
    if needed <= console.width:
        t = Table(title=title, title_justify="left")
        for c, num in zip(columns, numeric, strict=True):
            t.add_column(c, justify="right" if num else "left", no_wrap=True)
        for row in cells:
            t.add_row(*row)
        console.print(t)
        return
    console.print(Text(title, style="italic"))
    for row in cells:
        t = Table(show_header=False, box=None, padding=(0, 1))
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        for c, v in zip(columns, row, strict=True):
            t.add_row(c, v)
        console.print(t)
        console.print()
