"""What the command modules share: options in both spellings (``opt``, from cli_support), progress
on stderr, and the one way every command ends (JSON for scripts, or tables plus a PNG path for people).

Nothing here imports torch, so ``hydra-diag --help`` stays fast.
"""

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from hydra_kernels.cli_support import (
    EXIT_FAILURE,
    EXIT_USAGE,
    console,
    emit_json,
    err_console,
    fail,
    opt,
    reflowed,
)

# An error must stay ONE physical line in logs and pipes, where rich would wrap it at 80 columns
# (cli_support.fail prints without soft_wrap); soft-wrapping the shared stderr console keeps it whole.
err_console.soft_wrap = True


JsonOut = Annotated[bool, opt("--json", help="Print the result as JSON (for scripts) instead of tables.")]
PlotPath = Annotated[
    Path | None,
    opt(
        "--plot",
        "--out",
        help="Where to write the plot: a PNG, or the format its extension names (.svg, .pdf ...); "
        "default: a name of the tool's own.",
    ),
]
NoPlot = Annotated[bool, opt("--no_plot", help="Do not write the PNG.")]
ModelSize = Annotated[
    str, opt("--model_size", metavar="SIZE", help="Model preset: tiny, debug, 100M, 250M, 500M, 1B.")
]
Overrides = Annotated[
    list[str] | None,
    opt("--set", "--model_override", help="Override a HydraConfig field, FIELD=VALUE (repeatable)."),
]


def within(
    help: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> dict[str, Any]:
    """``opt("--x", **within("What x is.", 0, 1, lo_open=True))``: a number option's help with its
    range, and a callback that refuses a value outside it (or NaN) before the command runs, exit 2,
    as ``min=``/``max=`` do; these bounds may be open, which typer's cannot (and this typer takes
    no click type)."""
    if lo is not None and hi is not None:
        span = f"{lo:g}{'<' if lo_open else '<='}x{'<' if hi_open else '<='}{hi:g}"
    elif lo is not None:
        span = f"x{'>' if lo_open else '>='}{lo:g}"
    else:
        span = f"x{'<' if hi_open else '<='}{hi:g}"

    def check(value: float | None) -> float | None:
        if value is None:
            return value
        low = lo is not None and (value <= lo if lo_open else value < lo)
        high = hi is not None and (value >= hi if hi_open else value > hi)
        if low or high or math.isnan(value):
            raise typer.BadParameter(f"{value:g} is not in the range {span}.")
        return value

    return {"help": f"{help} ({span})", "callback": check}


def one_of(*choices: str) -> dict[str, Any]:
    """``opt("--x", help=..., **one_of("val", "train"))``: a word from a fixed list, refused before
    the command runs (exit 2) when it is another."""

    def check(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(f"{value!r}: use {' or '.join(choices)}.")
        return value

    return {"metavar": "|".join(choices), "callback": check}


def device_spec(value: str) -> str:
    """The --device callback: auto, cpu, cuda or cuda:N, else a usage error (exit 2) before any work;
    whether CUDA is there is for the command to find out (exit 1)."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise typer.BadParameter(f"{value!r}: use auto, cpu, cuda or cuda:N")


Device = Annotated[
    str,
    opt(
        "--device",
        metavar="DEVICE",
        help="auto (CUDA when present), cpu, cuda or cuda:N.",
        callback=device_spec,
    ),
]
Seed = Annotated[int, opt("--seed", help="Random seed (inputs, initialisation).")]
CheckpointOpt = Annotated[
    str | None,
    opt(
        "--checkpoint",
        metavar="PATH",
        help="A hydra-train checkpoint (.pt), a save_pretrained folder, or a run folder "
        "(its newest checkpoint). Default: a fresh model of --model_size.",
    ),
]
DatasetOpt = Annotated[
    str | None,
    opt(
        "--dataset",
        metavar="DATA",
        help="Data as hydra-train names it (stdlib, a name under $HYDRA_DATA_ROOT, a path), or "
        "'synthetic' (a learnable bigram stream). Default: the checkpoint's own dataset, else synthetic.",
    ),
]


@contextlib.contextmanager
def progress(description: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr with the latest message and the elapsed time; yields the callback that
    library functions call with what they are doing now."""
    if not enabled:
        yield lambda _msg: None
        return
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(description)
        t0 = time.perf_counter()

        def say(msg: str) -> None:
            text = escape(f"{description}: {msg}")  # a path or hint with [x] is text, not rich markup
            bar.update(task, description=text)
            if not err_console.is_terminal:  # logs and pipes get one plain line per step
                err_console.print(f"{escape(f'[{time.perf_counter() - t0:6.1f}s]')} {text}", highlight=False)

        yield say


def default_plot(plot: Path | None, no_plot: bool, name: str) -> Path | None:
    """The PNG path a command writes: ``--plot`` (checked by :func:`plot_target`), else ``<name>.png``
    here; None with ``--no-plot``. Called before the command's work, so a bad path costs nothing."""
    if no_plot:
        return None
    return plot_target(plot) if plot is not None else Path(f"{name}.png")


def plot_target(path: Path) -> Path:
    """The file ``--plot PATH`` will really be: a name without an extension gets ``.png`` (what
    matplotlib appends, so the path printed is the file written); a folder, or an extension
    matplotlib cannot write, is a usage error (exit 2) now rather than a traceback after the work."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path.is_dir():
        fail(f"--plot {path} is a folder; pass a file name such as {path / 'plot.png'}", EXIT_USAGE)
    if not path.suffix:
        return path.with_name(path.name + ".png")
    supported = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in supported:
        kinds = ", ".join(f".{k}" for k in sorted(supported))
        fail(f"--plot {path}: matplotlib cannot write {path.suffix} files; use one of {kinds}", EXIT_USAGE)
    return path


def run_guarded(fn: Callable[[], Any]) -> Any:
    """Call ``fn``; user-fixable errors become one line on stderr and exit status 1, a value wrong
    by itself (DiagUsageError, hydra-train's HydraUsageError) exit status 2."""
    from hydra_diag.output import DiagError, DiagUsageError

    try:
        return fn()
    except DiagError as exc:
        fail(str(exc), EXIT_USAGE if isinstance(exc, DiagUsageError) else EXIT_FAILURE)
    except FileNotFoundError as exc:
        fail(str(exc))
    except Exception as exc:
        from hydra_train.errors import HydraTrainError, HydraUsageError

        if isinstance(exc, HydraTrainError):
            fail(str(exc), EXIT_USAGE if isinstance(exc, HydraUsageError) else EXIT_FAILURE)
        raise


def finish(
    result: dict[str, Any],
    json_out: bool,
    render: Callable[[dict[str, Any], Any], None],
    *,
    plot: Callable[[dict[str, Any], Path], Path] | None = None,
    plot_path: Path | None = None,
    failed: bool | str = False,
) -> None:
    """Write the PNG (when asked), then print JSON or the tables; exit 1 when ``failed`` (a string
    is also said on stderr: the one line a script's log keeps)."""
    from hydra_diag.output import jsonable

    if plot is not None and plot_path is not None:
        result["plot"] = str(plot(result, plot_path))
    data = jsonable(result)
    if json_out:
        emit_json(data)
    else:
        render(data, console)
        if data.get("plot"):  # one line, as written: a path to copy, never wrapped or read as markup
            console.print(f"plot: {data['plot']}", highlight=False, soft_wrap=True, markup=False)
    if isinstance(failed, str):
        fail(failed)
    if failed:
        raise typer.Exit(EXIT_FAILURE)


def dump_json(result: dict[str, Any], path: Path) -> None:
    """Write a result as JSON to ``path`` (folders created)."""
    from hydra_diag.output import jsonable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=2) + "\n", encoding="utf-8")


def execute(
    label: str,
    compute: Callable[[Callable[[str], None]], dict[str, Any]],
    json_out: bool,
    render: Callable[[dict[str, Any], Any], None],
    *,
    plot: Callable[[dict[str, Any], Path], Path] | None = None,
    plot_path: Path | None = None,
    failed: Callable[[dict[str, Any]], bool | str] | None = None,
) -> None:
    """The body of every command: compute under a progress spinner, then :func:`finish`."""
    with progress(label) as say:
        result = run_guarded(lambda: compute(say))
    finish(
        result, json_out, render, plot=plot, plot_path=plot_path, failed=failed(result) if failed else False
    )


def reflow_help(app: typer.Typer) -> None:
    """:func:`hydra_kernels.cli_support.reflowed` for every hydra-diag command of ``app`` and its
    groups: in rich markup mode Typer keeps a docstring's single newlines, so hard-wrapped
    docstrings rendered ragged at 80 columns (a lone "the" on a line). hydra-train's db commands,
    mounted here too, are reflowed by hydra-train itself."""
    for info in app.registered_commands:
        cb = info.callback
        if cb is not None and cb.__module__.startswith("hydra_diag") and cb.__doc__:
            reflowed(cb)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)
