"""Small pieces every HYDRA command-line app shares (kept here, at the bottom of the stack).

They live in the lowest package so the other three can use them without pointing an import
upward. Nothing here imports torch, so ``--help`` stays fast.
"""

import inspect
import json
import math
import sys
from collections.abc import Callable, Iterable
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

#: Typer's exit code for bad usage; ours for everything else that fails.
EXIT_USAGE = 2
EXIT_FAILURE = 1


def new_app(help_text: str) -> typer.Typer:
    """A Typer group with HYDRA's defaults: help on no arguments, rich markup, no shell completion noise,
    option names never cut at 80 columns (cli_format.patch_typer_help)."""
    from hydra_kernels.cli_format import patch_typer_help

    patch_typer_help()
    return typer.Typer(
        help=help_text,
        no_args_is_help=True,
        rich_markup_mode="rich",
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def add_version_option(app: typer.Typer, dist_name: str, version: str) -> None:
    """Give ``app`` a ``--version`` flag that prints ``<dist_name> <version>`` and exits."""

    def _show(value: bool) -> None:
        if value:
            console.print(f"{dist_name} {version}")
            raise typer.Exit()

    @app.callback()
    def _root(
        _version: Annotated[
            bool,
            typer.Option(
                "--version", "-V", help="Print the version and exit.", callback=_show, is_eager=True
            ),
        ] = False,
    ) -> None:
        pass


def reflowed(func: Callable[..., Any]) -> Callable[..., Any]:
    """Join the source lines of each paragraph of ``func``'s docstring (its --help). In rich markup
    mode Typer keeps a docstring's single newlines in a group's command list and after the first
    paragraph of a command's own help, so a hard-wrapped docstring rendered ragged at 80 columns.
    Paragraphs (separated by a blank line) stay apart; the group lists the first one alone."""
    doc = inspect.cleandoc(func.__doc__ or "")
    func.__doc__ = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))
    return func


def opt(*names: str, help: str, **kw: Any) -> Any:
    """A Typer option under Typer's kebab-case spelling (printed first) and the seed documents'
    underscore one: ``opt("--max_steps", ...)`` takes ``--max-steps`` and ``--max_steps``."""
    spellings: list[str] = []
    for n in names:
        for s in (n.replace("_", "-"), n):
            if s not in spellings:
                spellings.append(s)
    return typer.Option(*spellings, help=help, **kw)


class AssignmentError(ValueError):
    """An item of a FIELD=VALUE option without the ``=``; ``item`` is the offending text."""

    def __init__(self, item: str) -> None:
        super().__init__(f"{item!r} is not FIELD=VALUE")
        self.item = item


def parse_assignments(items: Iterable[str] | None) -> dict[str, Any]:
    """``["dim=64", "moe_enabled=True", "mor_routing=token_choice"]`` → ``{"dim": 64,
    "moe_enabled": True, "mor_routing": "token_choice"}``: each value read as JSON (true, false and
    null in any letter case, so ``False`` is not the truthy string "False"), else kept as text.
    An item without ``=`` raises :class:`AssignmentError`; callers word the message for their flag."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise AssignmentError(item)
        key, raw = item.split("=", 1)
        literal = raw.lower()
        try:
            out[key.strip()] = json.loads(literal if literal in ("true", "false", "null") else raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw  # a bare string such as token_choice
    return out


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print one clear line to stderr and exit with ``code`` (1 for failures, 2 for bad usage)."""
    # soft_wrap: the message stays one line in pipes and logs instead of wrapping at 80 columns.
    # A Text is never parsed for markup or emoji codes: a path with "[red]" or ":train:" prints as-is.
    from rich.text import Text

    line = Text("error: ", style="bold red")
    line.append(" ".join(str(message).split("\n")))
    err_console.print(line, highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def require_cuda(tool: str) -> None:
    """Exit non-zero with one line when ``tool`` needs CUDA and this machine has none."""
    import torch

    if not torch.cuda.is_available():
        fail(f"{tool} needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False).")


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf) as None: ``json.dumps`` would write NaN or
    Infinity, which is not JSON, and a script's strict parser (``jq``, JavaScript) refuses it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def emit_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout for scripts (no rich markup, no wrapping); non-finite
    numbers are written as null."""
    sys.stdout.write(json.dumps(finite_json(obj), indent=2, default=str, allow_nan=False) + "\n")


def run_app(app: Callable[..., Any], prog_name: str) -> None:
    """Entry point for ``python -m <package>`` so it behaves exactly like the console script."""
    app(prog_name=prog_name)
