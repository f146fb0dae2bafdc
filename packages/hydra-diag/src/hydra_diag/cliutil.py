"""What the command modules share: options in both spellings (``opt``, from cli_support), progress
on stderr, and the one way every command ends (JSON for scripts, or tables plus a PNG path for people).

Nothing here imports torch, so ``hydra-diag --help`` stays fast.
"""

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from hydra_kernels.cli_support import console, emit_json, err_console, fail, opt

# An error must stay ONE physical line in logs and pipes, where rich would wrap it at 80 columns
# (cli_support.fail prints without soft_wrap); soft-wrapping the shared stderr console keeps it whole.
err_console.soft_wrap = True


JsonOut = Annotated[bool, opt("--json", help="Print the result as JSON (for scripts) instead of tables.")]
PlotPath = Annotated[
    Path | None, opt("--plot", "--out", help="Where to write the PNG (default: a name of the tool's own).")
]
NoPlot = Annotated[bool, opt("--no_plot", help="Do not write the PNG.")]
ModelSize = Annotated[
    str, opt("--model_size", metavar="SIZE", help="Model preset: tiny, debug, 100M, 250M, 500M, 1B.")
]
Overrides = Annotated[
    list[str] | None,
    opt("--set", "--model_override", help="Override a HydraConfig field, FIELD=VALUE (repeatable)."),
]
Device = Annotated[
    str, opt("--device", metavar="DEVICE", help="auto (CUDA when present), cpu, cuda or cuda:N.")
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
    """The PNG path a command writes: ``--plot``, else ``<name>.png`` here; None with ``--no-plot``."""
    if no_plot:
        return None
    return plot if plot is not None else Path(f"{name}.png")


def run_guarded(fn: Callable[[], Any]) -> Any:
    """Call ``fn``; user-fixable errors become one line on stderr and exit status 1."""
    from hydra_diag.output import DiagError

    try:
        return fn()
    except DiagError as exc:
        fail(str(exc))
    except FileNotFoundError as exc:
        fail(str(exc))
    except Exception as exc:
        from hydra_train.errors import HydraTrainError

        if isinstance(exc, HydraTrainError):
            fail(str(exc))
        raise


def finish(
    result: dict[str, Any],
    json_out: bool,
    render: Callable[[dict[str, Any], Any], None],
    *,
    plot: Callable[[dict[str, Any], Path], Path] | None = None,
    plot_path: Path | None = None,
    failed: bool = False,
) -> None:
    """Write the PNG (when asked), then print JSON or the tables; exit 1 when ``failed``."""
    from hydra_diag.output import jsonable

    if plot is not None and plot_path is not None:
        result["plot"] = str(plot(result, plot_path))
    data = jsonable(result)
    if json_out:
        emit_json(data)
    else:
        render(data, console)
        if data.get("plot"):
            console.print(f"plot: {data['plot']}", highlight=False)
    if failed:
        raise typer.Exit(1)


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
    failed: Callable[[dict[str, Any]], bool] | None = None,
) -> None:
    """The body of every command: compute under a progress spinner, then :func:`finish`."""
    with progress(label) as say:
        result = run_guarded(lambda: compute(say))
    finish(result, json_out, render, plot=plot, plot_path=plot_path, failed=bool(failed and failed(result)))
