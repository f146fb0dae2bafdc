"""Reading ``training.db`` for the dashboard: read-only, one short transaction per request.

The trainer writes in WAL mode (:class:`hydra_train.metrics_db.TrainingDB`). A WAL reader never
blocks the writer and sees the last committed state; we open a fresh read-only connection per
request (hydra-train's own, :func:`hydra_train.metrics_schema.connect`) and close it at once, so
no read snapshot is held open to stall the WAL checkpoints either. ``PRAGMA query_only`` on top
makes any write through this module an error.

Times (``started_at``, ``ended_at``) are UTC with an offset, an older version's rows local time
without one: they are ordered and compared through SQL ``utc_time()``, never as plain text.

:func:`check_database` turns every unusable input (missing, not SQLite, empty, an older schema)
into one :class:`DiagError` line before the server starts.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from hydra_diag.output import DiagError, jsonable
from hydra_diag.run_db import check_hydra_tables
from hydra_train.errors import HydraDataError
from hydra_train.metrics_db import DB_NAME
from hydra_train.metrics_schema import connect

SQLITE_HEADER = b"SQLite format 3\x00"

#: Per-run tables the page reads incrementally, with the columns it needs (ordered by step, layer).
INCREMENTAL: dict[str, str] = {
    "steps": "step, time, loss, ce_loss, aux_loss, lr, grad_norm, tokens_per_s, tokens_seen, memory_mb, "
    "skipped_steps, ema_short, ema_medium, ema_long",
    "evals": "step, val_loss, val_ppl",
    "adaptive_lr": "step, lr, base_lr, factor, phase",
    "routing_mod": "step, layer, selected_frac, capacity, router_prob_mean, compute_savings",
    "routing_mor": "step, layer, avg_depth, expected_depth",
    "routing_moe": "step, layer, entropy, utilization, kl_to_uniform, max_violation",
}
#: Tables thinned to at most ``max_rows`` rows a response (evaluations are few, and the page takes
#: the best validation loss from all of them)
THINNED = ("steps", "adaptive_lr", "routing_mod", "routing_mor", "routing_moe")
RUN_COLUMNS = (
    "r.run_id, r.model_id, r.status, r.start_step, r.end_step, r.best_loss, r.best_val_loss, "
    "r.final_val_loss, r.tokens_per_s, r.resumed_from, r.device, r.world_size, r.started_at, r.ended_at, "
    "m.size, m.params"
)


def thin_by_step(rows: list[dict[str, Any]], max_rows: int) -> list[dict[str, Any]]:
    """At most about ``max_rows`` of ``rows`` (ordered by step): every k-th logged step, all of a
    step's rows (its layers) together, and always the last step, so a caller's cursor still lands
    on the newest row and later polls continue from it."""
    if len(rows) <= max_rows:
        return rows
    steps = sorted({r["step"] for r in rows})
    per_step = max(1, len(rows) // len(steps))
    stride = -(-len(steps) * per_step // max(max_rows - per_step, 1))  # ceil, the last step added
    kept = set(steps[::stride]) | {steps[-1]}
    return [r for r in rows if r["step"] in kept]


def schema_columns() -> dict[str, list[str]]:
    """Column names of every table hydra-train's current schema defines."""
    from hydra_train.metrics_db import SCHEMA

    out = {}
    for table, cols in SCHEMA.items():
        names = [part.strip().split()[0] for part in cols.split(",") if part.strip()]
        out[table] = [n for n in names if n.isidentifier() and n != "PRIMARY"]
    return out


def resolve_db(path: str | Path) -> Path:
    """The database file: ``path`` itself, or ``path/training.db`` for a checkpoint folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / DB_NAME
    if not p.is_file():
        raise DiagError(
            f"no metrics database at {p}: pass the --checkpoint_dir of a hydra-train run (it holds "
            f"{DB_NAME}) or the database file itself"
        )
    return p


def connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection: hydra-train's (``mode=ro``, never creates or writes a file, sees a
    live writer's commits; a run copied into a write-protected folder is read too), with SQL
    ``utc_time()``. Its errors are :class:`DiagError`, which the server answers with a 503."""
    try:
        conn = connect(path, read_only=True)
    except HydraDataError as exc:  # the file went away (a rebuild), or a copy it cannot read
        raise DiagError(str(exc)) from None
    conn.execute("PRAGMA query_only=ON")
    return conn


def check_database(path: str | Path) -> Path:
    """The database file behind ``path``, or a one-line :class:`DiagError` saying why it is unusable."""
    p = resolve_db(path)
    with open(p, "rb") as f:
        header = f.read(len(SQLITE_HEADER))
    if not header:
        raise DiagError(
            f"{p} is an empty file (0 bytes), not a metrics database yet: start a hydra-train run"
        )
    if header != SQLITE_HEADER:
        raise DiagError(
            f"{p} is not an SQLite database (no SQLite header): pass the {DB_NAME} a hydra-train run "
            "wrote (in its --checkpoint_dir)"
        )
    try:
        conn = connect_ro(p)
        try:
            tables = {
                r[0]: [c[1] for c in conn.execute(f"PRAGMA table_info({r[0]})")]
                for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            n_runs = conn.execute("SELECT count(*) FROM runs").fetchone()[0] if "runs" in tables else 0
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DiagError(f"{p} cannot be read as an SQLite database: {exc}") from None
    if not tables:
        raise DiagError(f"{p} is an empty database (no tables): start a hydra-train run that writes it")
    check_hydra_tables(p, set(tables))  # another program's database: no rebuild would help
    gaps = []
    for table, cols in schema_columns().items():
        if table not in tables:
            gaps.append(f"no table {table}")
        elif missing := [c for c in cols if c not in tables[table]]:
            gaps.append(f"{table} lacks {', '.join(missing)}")
    if gaps:
        raise DiagError(
            f"{p} has an older schema than this hydra-train's ({'; '.join(gaps)}): rebuild it with "
            "`hydra-train db rebuild` from the run's diagnostics_*.json exports"
        )
    if n_runs == 0:
        raise DiagError(f"{p} holds no runs yet (empty database): start a hydra-train run that writes it")
    return p


class DashboardStore:
    """The queries behind the JSON endpoints, each on its own short read-only connection."""

    def __init__(self, path: str | Path):
        self.path = check_database(path)
        self.folder = self.path.parent

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        conn = connect_ro(self.path)
        try:
            return [dict(r) for r in conn.execute(sql, params).fetchall()]
        finally:
            conn.close()

    def runs(self) -> list[dict[str, Any]]:
        """Every run, oldest first, with its last logged step and how many steps it logged."""
        rows = self._query(
            f"SELECT {RUN_COLUMNS}, (SELECT max(step) FROM steps s WHERE s.run_id=r.run_id) AS last_step, "
            "(SELECT count(*) FROM steps s WHERE s.run_id=r.run_id) AS logged_steps "
            "FROM runs r LEFT JOIN models m ON m.model_id=r.model_id ORDER BY utc_time(r.started_at), r.rowid"
        )
        return jsonable(rows)

    def run(
        self, run_id: str, since: dict[str, int] | None = None, max_rows: int | None = None
    ) -> dict[str, Any] | None:
        """One run's rows logged after the steps in ``since`` (table → last step the caller holds;
        -1 or absent: all rows), ``last`` (table → its last step now, None when empty) and its
        SafeOptimizations status. None for an unknown run. ``max_rows``: each table of
        :data:`THINNED` thinned to about that many rows (:func:`thin_by_step`): the first load of a
        long run is then a few MB, not one row per logged step and layer."""
        from hydra_diag.dashboard.safe_events import safe_opts_report

        since = since or {}
        conn = connect_ro(self.path)
        try:
            conn.execute("BEGIN")  # one snapshot: the tables agree with each other
            head = conn.execute(
                f"SELECT {RUN_COLUMNS}, r.config FROM runs r LEFT JOIN models m ON m.model_id=r.model_id "
                "WHERE r.run_id=?",
                (run_id,),
            ).fetchone()
            if head is None:
                return None
            out: dict[str, Any] = {"run": dict(head)}
            for table, cols in INCREMENTAL.items():
                order = "step, layer" if "layer" in cols else "step"
                out[table] = [
                    dict(r)
                    for r in conn.execute(
                        f"SELECT {cols} FROM {table} WHERE run_id=? AND step>? ORDER BY {order}",
                        (run_id, int(since.get(table, -1))),
                    )
                ]
            # the last step each table holds now: below the caller's cursor when a resume dropped
            # the rows this run logged after its checkpoint (TrainingDB.drop_superseded)
            out["last"] = {
                table: conn.execute(f"SELECT max(step) FROM {table} WHERE run_id=?", (run_id,)).fetchone()[0]
                for table in INCREMENTAL
            }
            # the next run's start bounds a killed run's events (safe_events._in_run)
            next_start = conn.execute(
                "SELECT min(utc_time(started_at)) FROM runs WHERE utc_time(started_at) > utc_time(?)",
                (head["started_at"] or "",),
            ).fetchone()[0]
            conn.rollback()
        finally:
            conn.close()
        if max_rows is not None:
            for table in THINNED:
                out[table] = thin_by_step(out[table], max_rows)
        for row in out["routing_moe"]:
            row["utilization"] = json.loads(row["utilization"]) if row.get("utilization") else []
        try:
            config = json.loads(out["run"].pop("config") or "{}")
        except json.JSONDecodeError:
            config = {}
        out["config"] = config
        out["safe_opts"] = safe_opts_report(self.folder, out["run"], config, next_start)
        return jsonable(out)
