"""Queries of the metrics database beyond hydra-train's own ``db`` commands (which hydra-diag
re-exports unchanged): the latest routing per layer, the evaluations, chosen step columns, and a
read-only SQL prompt. Everything goes through :class:`hydra_train.metrics_db.TrainingDB`."""

from __future__ import annotations

import json
from typing import Any

from hydra_diag.output import DiagError
from hydra_diag.run_db import db_path, pick_run

STEP_COLUMNS = (
    "step",
    "loss",
    "ce_loss",
    "aux_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_seen",
    "memory_mb",
    "skipped_steps",
    "ema_short",
    "ema_medium",
    "ema_long",
)


def routing_latest(path: str, run_id: str | None = None, step: int | None = None) -> dict[str, Any]:
    """MoD, MoR and MoE rows of one logged step (the last one by default) of a run."""
    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(db_path(path), read_only=True) as db:
        run = pick_run(db, run_id, None)
        rid = run["run_id"]
        logged = [
            r["step"]
            for r in db.query(
                "SELECT step FROM routing_mod WHERE run_id=? UNION SELECT step FROM routing_mor WHERE "
                "run_id=? UNION SELECT step FROM routing_moe WHERE run_id=? ORDER BY step",
                [rid, rid, rid],
            )
        ]
        if not logged:
            raise DiagError(f"run {rid} logged no routing rows (a model without routers, or none logged yet)")
        if step is None:
            step = logged[-1]
        elif step not in logged:  # a header and empty lists, exit 0, said nothing about why
            raise DiagError(f"no routing rows at step {step}; logged steps: {step_list(logged)}")
        out: dict[str, Any] = {"run_id": rid, "step": step}
        for table in ("routing_mod", "routing_mor", "routing_moe"):
            rows = db.query(f"SELECT * FROM {table} WHERE run_id=? AND step=? ORDER BY layer", [rid, step])
            for r in rows:
                r.pop("run_id", None)
                for key in ("depth_hist", "utilization"):
                    if isinstance(r.get(key), str):
                        r[key] = json.loads(r[key])
            out[table.removeprefix("routing_")] = rows
    return out


def step_list(steps: list[int], most: int = 12) -> str:
    """``4, 8, 12, 16``; a long list as its first and last few steps with the count between."""
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    half = most // 2
    head, tail = ", ".join(map(str, steps[:half])), ", ".join(map(str, steps[-half:]))
    return f"{head}, ... ({len(steps) - most} more), {tail}"


def evals(path: str, run_id: str | None = None) -> dict[str, Any]:
    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(db_path(path), read_only=True) as db:
        run = pick_run(db, run_id, None)
        rows = db.query(
            "SELECT step, val_loss, val_ppl FROM evals WHERE run_id=? ORDER BY step", [run["run_id"]]
        )
    return {"run_id": run["run_id"], "evals": rows}


def steps(
    path: str, run_id: str | None = None, columns: list[str] | None = None, last: int = 20
) -> dict[str, Any]:
    from hydra_train.metrics_db import TrainingDB

    cols = list(columns or ("step", "loss", "ce_loss", "lr", "grad_norm", "tokens_per_s", "ema_short"))
    bad = [c for c in cols if c not in STEP_COLUMNS]
    if bad:
        raise DiagError(f"unknown step column(s) {bad}; choose from {', '.join(STEP_COLUMNS)}")
    if "step" not in cols:
        cols.insert(0, "step")
    with TrainingDB(db_path(path), read_only=True) as db:
        run = pick_run(db, run_id, None)
        rows = db.query(
            f"SELECT {', '.join(cols)} FROM steps WHERE run_id=? ORDER BY step DESC LIMIT ?",
            [run["run_id"], last],
        )
    return {"run_id": run["run_id"], "columns": cols, "rows": rows[::-1]}


def read_only_query(path: str, sql: str, params: list[Any] | None = None, limit: int = 200) -> dict[str, Any]:
    """Run one SQL statement with the connection in query-only mode (writes are refused by SQLite)."""
    import sqlite3

    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(db_path(path), read_only=True) as db:
        db.conn.execute("PRAGMA query_only=ON")
        try:
            cur = db.conn.execute(sql, tuple(params or ()))
            rows = [dict(r) for r in cur.fetchmany(limit + 1)]
        except sqlite3.Error as exc:
            raise DiagError(f"SQL error: {exc}") from None
        finally:
            db.conn.execute("PRAGMA query_only=OFF")
    return {"sql": sql, "rows": rows[:limit], "truncated": len(rows) > limit}
