"""The `hydra-diag` command line: one Typer app, one group per kind of diagnostic.

Groups are imported here but their heavy dependencies (torch, matplotlib) load only when a command
runs, so ``hydra-diag --help`` stays fast.
"""

from typing import Annotated

from hydra_diag import __version__
from hydra_diag.cliutil import opt, reflow_help
from hydra_diag.commands import analyze, bench, convert, db, evaluate, health, moe, profile, race, sweep
from hydra_diag.commands.dashboard import dashboard_cmd
from hydra_kernels.cli_support import add_version_option, console, emit_json, new_app

app = new_app("Diagnostics and benchmarks for HYDRA models, kernels and runs.")
add_version_option(app, "hydra-diag", __version__)

app.add_typer(bench.app, name="bench")
app.add_typer(sweep.app, name="sweep")
app.add_typer(profile.app, name="profile")
app.add_typer(health.app, name="health")
app.add_typer(evaluate.app, name="eval")
app.add_typer(analyze.app, name="analyze")
app.add_typer(moe.app, name="moe")
app.add_typer(convert.app, name="convert")
app.add_typer(db.app, name="db")
app.add_typer(race.app, name="race")
app.command("dashboard")(dashboard_cmd)


@app.command("tools")
def tools_cmd(json_out: Annotated[bool, opt("--json", help="Print JSON.")] = False) -> None:
    """Every tool of the seed's diagnostics list: its command, whether it needs CUDA, what it does."""
    from hydra_diag.render import rows_table
    from hydra_diag.tools import list_tools

    rows = list_tools()
    if json_out:
        emit_json(rows)
    else:
        console.print(rows_table("hydra-diag tools (python -m hydra_diag NAME runs one)", rows))


# last: every command is registered by now (Typer reads the docstrings when the app first runs)
reflow_help(app)
