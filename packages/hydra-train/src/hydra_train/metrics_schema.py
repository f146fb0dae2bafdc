"""The metrics database's file format: its name, its tables' columns, its times, the check that a
file is SQLite before anything writes into it, and opening it (:func:`connect`).
:mod:`hydra_train.metrics_db` reads and writes it.

Tables (primary keys in brackets)::

    models       [model_id] size, params, params_non_embedding, architecture (HydraConfig JSON), created_at
    runs         [run_id] model_id, status (running|finished|stopped|failed|interrupted|killed: a
                 run found dead by the next one), start_step, end_step, best_loss, best_val_loss,
                 final_val_loss, tokens_per_s, resumed_from, device, world_size,
                 config (TrainConfig JSON), started_at, ended_at
    steps        [run_id, step] time, loss, ce_loss, aux_loss, aux (JSON: term -> value), lr, grad_norm,
                 tokens_per_s, tokens_seen, memory_mb, skipped_steps, ema_short, ema_medium, ema_long
    evals        [run_id, step] val_loss, val_ppl
    routing_mod  [run_id, step, layer] selected_frac, capacity, router_prob_mean, compute_savings
    routing_mor  [run_id, step, layer] avg_depth, expected_depth, depth_hist (JSON list)
    routing_moe  [run_id, step, layer] entropy, utilization (JSON list), kl_to_uniform, max_violation
    adaptive_lr  [run_id, step] lr, base_lr, factor, phase (warmup|stable|decay|cosine)

Times (``created_at``, ``started_at``, ``ended_at``) are ISO 8601 in UTC with the offset, to the
millisecond (``2026-11-28T10:42:39.123+00:00``, :func:`utc_now`). Databases of older versions hold
local time without an offset; :func:`utc_time` reads both, and SQL sees it as ``utc_time(column)``
on a connection :func:`connect` opened: order and compare times through it, not as plain strings.
"""

from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from hydra_train.errors import HydraDataError

DB_NAME = "training.db"
EXPORT_FORMAT = "hydra-train-diagnostics"

SCHEMA: dict[str, str] = {
    "models": "model_id TEXT PRIMARY KEY, size TEXT, params INTEGER, params_non_embedding INTEGER, "
    "architecture TEXT, created_at TEXT",
    "runs": "run_id TEXT PRIMARY KEY, model_id TEXT, status TEXT, start_step INTEGER, end_step INTEGER, "
    "best_loss REAL, best_val_loss REAL, final_val_loss REAL, tokens_per_s REAL, resumed_from TEXT, "
    "device TEXT, world_size INTEGER, config TEXT, started_at TEXT, ended_at TEXT",
    "steps": "run_id TEXT, step INTEGER, time REAL, loss REAL, ce_loss REAL, aux_loss REAL, aux TEXT, "
    "lr REAL, grad_norm REAL, tokens_per_s REAL, tokens_seen INTEGER, memory_mb REAL, skipped_steps INTEGER, "
    "ema_short REAL, ema_medium REAL, ema_long REAL, PRIMARY KEY (run_id, step)",
    "evals": "run_id TEXT, step INTEGER, val_loss REAL, val_ppl REAL, PRIMARY KEY (run_id, step)",
    "routing_mod": "run_id TEXT, step INTEGER, layer INTEGER, selected_frac REAL, capacity REAL, "
    "router_prob_mean REAL, compute_savings REAL, PRIMARY KEY (run_id, step, layer)",
    "routing_mor": "run_id TEXT, step INTEGER, layer INTEGER, avg_depth REAL, expected_depth REAL, "
    "depth_hist TEXT, PRIMARY KEY (run_id, step, layer)",
    "routing_moe": "run_id TEXT, step INTEGER, layer INTEGER, entropy REAL, utilization TEXT, "
    "kl_to_uniform REAL, max_violation REAL, PRIMARY KEY (run_id, step, layer)",
    "adaptive_lr": "run_id TEXT, step INTEGER, lr REAL, base_lr REAL, factor REAL, phase TEXT, "
    "PRIMARY KEY (run_id, step)",
}


_SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite_file(path: Path, *, allow_empty: bool = True) -> None:
    """Refuse an existing file that is not an SQLite database instead of writing a schema into it:
    it is someone else's file. A 0-byte file is what SQLite itself leaves when a writer dies before
    its first commit: a run may initialise it (``allow_empty``), a read-only command refuses it."""
    if not path.exists():
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise HydraDataError(f"{path}: cannot read the metrics database ({exc.strerror})") from None
    if head != _SQLITE_MAGIC and (head or not allow_empty):
        what = "is empty (0 bytes)" if not head else "is not an SQLite database"
        raise HydraDataError(
            f"{path} {what}; move it away (hydra-train db rebuild recreates it from the "
            "diagnostics_*.json exports)"
        )


def utc_now(timespec: str = "milliseconds") -> str:
    """A time to store: now, in UTC with its offset, to the millisecond (or ``timespec``)."""
    return datetime.now(timezone.utc).isoformat(timespec=timespec)


def utc_time(stamp: str | None, timespec: str = "milliseconds") -> str | None:
    """``stamp`` in UTC with its offset, to the millisecond (or ``timespec``): two such strings
    compare as their times do. A stamp without an offset (an older version's row) is taken as
    local time, the zone it was written in when the run ran on this machine. None, and a stamp
    that is no ISO time, as they are."""
    if not isinstance(stamp, str):
        return stamp
    try:
        t = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    return t.astimezone(timezone.utc).isoformat(timespec=timespec)


def connect(path: Path, *, read_only: bool) -> sqlite3.Connection:
    """A connection to the database at ``path`` with :func:`utc_time` as an SQL function. A writer
    gets WAL mode and the tables (made when missing). ``read_only`` writes nothing: see
    :func:`_open_read_only`."""
    if read_only:
        conn = _open_read_only(path)
    else:
        conn = sqlite3.connect(path, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        for table, cols in SCHEMA.items():
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} ({cols})")
        conn.execute("CREATE INDEX IF NOT EXISTS runs_by_model ON runs(model_id)")
        conn.commit()
    conn.row_factory = sqlite3.Row
    conn.create_function("utc_time", 1, utc_time, deterministic=True)
    return conn


def _open_read_only(path: Path) -> sqlite3.Connection:
    """``mode=ro``: SQLite changes neither the file nor its journal mode, creates no file where
    there is none, and still reads what a live writer has committed to its write-ahead log. (In a
    folder it may write, a WAL database gets the empty -wal and -shm files every WAL reader needs.)
    A table the file lacks (an older schema) is an empty TEMP table, so that the queries answer
    nothing rather than fail; a file with none of them (another program's) is refused. A WAL
    database in a folder where SQLite can create no -shm file (a run copied read-only, chmod -w, a
    read-only mount) and with no write-ahead log beside it is opened ``immutable``: no WAL writer
    has it open (one keeps its -wal there)."""
    if not path.is_file():
        raise HydraDataError(f"no metrics database at {path}")
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=30.0)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.OperationalError as exc:
        conn.close()
        wal = Path(f"{path}-wal")
        if os.access(path.parent, os.W_OK):
            raise HydraDataError(f"{path}: cannot be read ({exc})") from None
        if wal.is_file() and wal.stat().st_size > 0:  # immutable would skip its committed rows
            raise HydraDataError(
                f"{path}: cannot be read in a write-protected folder with its write-ahead log "
                f"{wal.name} and no {path.name}-shm ({exc}); copy the folder somewhere writable"
            ) from None
        conn = sqlite3.connect(uri + "&immutable=1", uri=True)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    foreign = foreign_database(path, tables)
    if foreign is not None:  # stand-ins would read it as a database with no runs: exit 0, empty
        conn.close()
        raise HydraDataError(foreign)
    for table, cols in SCHEMA.items():
        if table not in tables:
            conn.execute(f"CREATE TEMP TABLE {table} ({cols})")
    return conn


def foreign_database(path: Path, tables: set[str]) -> str | None:
    """The refusal of an SQLite file that holds tables but none of hydra-train's (another
    program's), else None. An empty file, or one with some of the tables (an older schema), is
    not foreign: it reads as a database with fewer rows."""
    own = {t for t in tables if not t.startswith("sqlite_")}
    if not own or own & SCHEMA.keys():
        return None
    listed = ", ".join(sorted(own)[:5]) + (", ..." if len(own) > 5 else "")
    return (
        f"{path} is not a hydra-train metrics database (no HYDRA tables; it holds {listed}): pass "
        f"the {DB_NAME} a hydra-train run wrote (in its --checkpoint_dir)"
    )
