"""hydra_kernels.cli_format's --help panel: patched in only where Typer has what it reads."""

from typing import Annotated

import pytest
import typer
import typer.rich_utils as ru
from typer.core import TyperOption
from typer.testing import CliRunner

from hydra_kernels import cli_format


def _app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True)

    @app.command()
    def run(
        the_count: Annotated[
            int, typer.Option("--the-count", "--the_count", min=1, max=9, help="how many")
        ] = 2,
    ) -> None:
        """Run."""

    @app.command()
    def other() -> None:
        """Another command, so that `run` is a subcommand."""

    return app


@pytest.fixture
def fresh_patch(monkeypatch):
    """patch_typer_help as on a first import, Typer's own panel put back afterwards."""
    monkeypatch.setattr(cli_format, "_patched", False)
    monkeypatch.setattr(ru, "_print_options_panel", ru._print_options_panel)


def test_the_panel_lists_every_spelling_and_the_range(fresh_patch):
    if not all(hasattr(TyperOption, n) for n in cli_format.OPTION_API):
        pytest.skip("this Typer keeps its own panel (the test below)")
    cli_format.patch_typer_help()
    assert ru._print_options_panel is cli_format._options_panel
    result = CliRunner().invoke(_app(), ["run", "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    # the spellings wrap between each other, never inside one; nothing is cut short
    assert "--the-count," in result.output and "--the_count" in result.output
    assert "[1<=x<=9]" in result.output and "…" not in result.output


def test_a_typer_without_the_option_api_keeps_its_own_panel(fresh_patch, monkeypatch):
    """Typer 0.27 (its own vendored click) has no TyperOption._get_number_range_help_str, and its
    own panel does not need it: with this panel patched in anyway, every --help raised
    AttributeError (seen on a GPU machine's image). Simulated: the method removed and Typer's
    panel a stand-in that reads names only."""
    shown = []

    def typer_own_panel(*, name, params, ctx, markup_mode, console) -> None:
        shown.extend(o for p in params for o in getattr(p, "opts", []))

    monkeypatch.delattr(TyperOption, "_get_number_range_help_str", raising=False)  # 0.27: absent
    monkeypatch.setattr(ru, "_print_options_panel", typer_own_panel)
    cli_format.patch_typer_help()
    assert ru._print_options_panel is typer_own_panel
    result = CliRunner().invoke(_app(), ["run", "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "--the-count" in shown
