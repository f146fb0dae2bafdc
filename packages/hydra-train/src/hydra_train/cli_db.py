"""``hydra-train db``: query the metrics database (<checkpoint_dir>/training.db). Registered on the
app in :mod:`hydra_train.cli`; hydra-diag mounts the same group as ``hydra-diag db``.

No ``from __future__ import annotations`` here: Typer reads these annotations at run time.
"""

from pathlib import Path
from typing import Annotated

from hydra_kernels.cli_support import console, emit_json, fail, new_app, reflowed
from hydra_kernels.cli_support import opt as _opt

H = {
    "start": "First step to show.",
    "limit": "At most this many rows, evenly spaced (0: all).",
}

db_app = new_app("Query the metrics database (<checkpoint_dir>/training.db).")

CkptDir = Annotated[
    str, _opt("--checkpoint_dir", help="Folder holding training.db and the diagnostics_*.json exports.")
]
Model = Annotated[str | None, _opt("--model", help="Only this model id (e.g. tiny, 100m).")]
Json = Annotated[bool, _opt("--json", help="Machine-readable output.")]


def _open_db(checkpoint_dir: str):
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    path = Path(checkpoint_dir) / DB_NAME
    if not path.is_file():
        fail(
            f"no metrics database at {path}; train first (hydra-train run) or rebuild it "
            "(hydra-train db rebuild)"
        )
    from hydra_train.errors import HydraTrainError

    try:
        return TrainingDB(path, read_only=True)
    except HydraTrainError as exc:
        fail(str(exc))


def _check_model(db, model: str | None) -> None:
    """A --model the database does not hold stops with one line listing the ones it does (stats
    showed a row of nulls for a mistyped id, the other commands nothing)."""
    if model is None:
        return
    known = db.model_ids()
    if model not in known:  # the caller's `with` closes the database on the way out
        fail(f"no model {model!r} in {db.path}; it holds: {', '.join(known) or 'no models yet'}")


def _when(stamp: str | None) -> str | None:
    """A runs-table time for the table: to the minute, in UTC; an older version's stamp (local time
    without an offset, whose zone the database does not record) as written, marked ``local``.
    ``--json`` gives the stored ISO strings."""
    from datetime import datetime, timezone

    try:
        t = datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return stamp
    if t.tzinfo is None:
        return f"{t:%Y-%m-%d %H:%M} local"
    return f"{t.astimezone(timezone.utc):%Y-%m-%d %H:%M} UTC"


def _table(title: str, rows: list[dict], columns: list[str]) -> None:
    from hydra_kernels.cli_format import print_records

    print_records(console, title, rows, columns)


@db_app.command("stats")
def db_stats(checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False) -> None:
    """Per model: runs, logged steps, last step, best and last loss, EMAs, best validation loss."""
    with _open_db(checkpoint_dir) as db:
        _check_model(db, model)
        rows = db.stats(model)
    if json_out:
        return emit_json(rows)
    _table(
        "models",
        rows,
        [
            "model_id",
            "params",
            "runs",
            "logged_steps",
            "last_step",
            "tokens_seen",
            "best_loss",
            "last_loss",
            "ema_short",
            "ema_long",
            "best_val_loss",
        ],
    )


@db_app.command("milestones")
def db_milestones(
    checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False
) -> None:
    """The first step at which the short-EMA loss went below each threshold."""
    with _open_db(checkpoint_dir) as db:
        _check_model(db, model)
        rows = db.milestones(model)
    if json_out:
        return emit_json(rows)
    _table(
        "loss milestones (ema_short)",
        rows,
        ["model_id", "threshold", "step", "tokens_seen", "ema_short", "run_id"],
    )


@db_app.command("ema")
def db_ema(
    checkpoint_dir: CkptDir = "checkpoints",
    model: Model = None,
    start: Annotated[int, _opt("--start", help=H["start"])] = 0,
    # min=0: a negative limit showed one row, silently (TrainingDB.ema's spacing ran backwards)
    limit: Annotated[int, _opt("--limit", min=0, help=H["limit"])] = 40,
    json_out: Json = False,
) -> None:
    """Loss with its short (0.99), medium (0.999) and long (0.9999) EMAs from --start on."""
    with _open_db(checkpoint_dir) as db:
        _check_model(db, model)
        rows = db.ema(model, start=start, limit=limit)
    if json_out:
        return emit_json(rows)
    _table(
        f"multi-scale EMA from step {start}",
        rows,
        ["model_id", "step", "loss", "ema_short", "ema_medium", "ema_long", "run_id"],
    )


@db_app.command("runs")
@reflowed
def db_runs(checkpoint_dir: CkptDir = "checkpoints", model: Model = None, json_out: Json = False) -> None:
    """Every run: status, steps, best training loss, best and final validation loss, tokens/s, what
    it resumed from, the device, when it started and ended.

    --json names the best training loss best_loss."""
    with _open_db(checkpoint_dir) as db:
        _check_model(db, model)
        rows = db.runs(model)
    if json_out:
        return emit_json(rows)
    # best_loss is the training loss: named so beside the validation losses (--json keeps the
    # stored name). At 80 columns the table becomes one block per run (print_records), never cut.
    _table(
        "runs",
        [
            {
                **r,
                "best_train_loss": r["best_loss"],
                "started_at": _when(r["started_at"]),
                "ended_at": _when(r["ended_at"]),
            }
            for r in rows
        ],
        [
            "run_id",
            "model_id",
            "status",
            "start_step",
            "end_step",
            "best_train_loss",
            "best_val_loss",
            "final_val_loss",
            "tokens_per_s",
            "resumed_from",
            "device",
            "started_at",
            "ended_at",
        ],
    )


@db_app.command("rebuild")
def db_rebuild(checkpoint_dir: CkptDir = "checkpoints", json_out: Json = False) -> None:
    """Recreate training.db from the diagnostics_*.json exports in --checkpoint_dir."""
    from hydra_train.metrics_db import rebuild_database

    try:
        path, run_ids = rebuild_database(checkpoint_dir)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        return emit_json({"database": str(path), "runs": run_ids})
    console.print(f"rebuilt {path} from {len(run_ids)} export(s): {', '.join(run_ids)}", highlight=False)
