"""``hydra-diag db``: hydra-train's ``db`` commands (stats, milestones, ema, runs, rebuild), re-exported
as they are, plus routing, evals, steps and a read-only SQL query."""

from typing import Annotated

import typer

from hydra_diag.cliutil import JsonOut, execute, opt
from hydra_kernels.cli_support import new_app
from hydra_train.cli import db_app as _train_db_app

app = new_app(
    "Query the metrics database (<checkpoint_dir>/training.db): hydra-train's db commands and more."
)


# the same command objects hydra-train registers: one implementation, two entry points (another
# program's SQLite file is refused by hydra-train's read-only connection, for both)
app.registered_commands.extend(_train_db_app.registered_commands)

Folder = Annotated[str, opt("--checkpoint_dir", help="Folder holding training.db (or the database file).")]
RunId = Annotated[str | None, opt("--run", help="Run id (default: the most recently started run).")]


@app.command("routing")
def routing_cmd(
    checkpoint_dir: Folder = "checkpoints",
    run: RunId = None,
    step: Annotated[
        int | None, opt("--step", help="Logged step (default: the last with routing rows).")
    ] = None,
    json_out: JsonOut = False,
) -> None:
    """MoD, MoR and MoE routing statistics per layer at one logged step of a run."""
    from hydra_diag.db_queries import routing_latest
    from hydra_diag.render import rows_table

    def render(r, console):
        console.print(f"run {r['run_id']}, step {r['step']}", highlight=False)
        for kind in ("mod", "mor", "moe"):
            if r.get(kind):
                console.print(
                    rows_table(
                        f"routing_{kind}", r[kind], formats={"depth_hist": ".3f", "utilization": ".3f"}
                    )
                )

    execute("db routing", lambda say: routing_latest(checkpoint_dir, run, step), json_out, render)


@app.command("evals")
def evals_cmd(checkpoint_dir: Folder = "checkpoints", run: RunId = None, json_out: JsonOut = False) -> None:
    """Validation loss and perplexity at every evaluation of a run."""
    from hydra_diag.db_queries import evals
    from hydra_diag.render import rows_table

    execute(
        "db evals",
        lambda say: evals(checkpoint_dir, run),
        json_out,
        lambda r, console: console.print(rows_table(f"evaluations of run {r['run_id']}", r["evals"])),
    )


@app.command("steps")
def steps_cmd(
    checkpoint_dir: Folder = "checkpoints",
    run: RunId = None,
    columns: Annotated[list[str] | None, opt("--column", help="Column to show (repeatable).")] = None,
    last: Annotated[int, opt("--last", help="Show the last N logged steps.", min=1)] = 20,
    json_out: JsonOut = False,
) -> None:
    """The last logged steps of a run with the chosen columns (loss, lr, grad_norm, EMAs, memory ...)."""
    from hydra_diag.db_queries import steps
    from hydra_diag.render import rows_table

    execute(
        "db steps",
        lambda say: steps(checkpoint_dir, run, columns, last),
        json_out,
        lambda r, console: console.print(rows_table(f"steps of run {r['run_id']}", r["rows"], r["columns"])),
    )


@app.command("query")
def query_cmd(
    sql: Annotated[str, typer.Argument(metavar="SQL", help="One SQL statement (read-only).")],
    checkpoint_dir: Folder = "checkpoints",
    limit: Annotated[int, opt("--limit", help="At most this many rows.", min=1)] = 200,
    json_out: JsonOut = False,
) -> None:
    """Run one read-only SQL statement against training.db (the connection refuses writes)."""
    from hydra_diag.db_queries import read_only_query
    from hydra_diag.render import rows_table

    def render(r, console):
        console.print(rows_table(r["sql"], r["rows"]) if r["rows"] else "no rows")
        if r["truncated"]:
            console.print(f"[dim](first {limit} rows)[/]")

    execute("db query", lambda say: read_only_query(checkpoint_dir, sql, limit=limit), json_out, render)
