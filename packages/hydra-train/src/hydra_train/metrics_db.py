"""The SQLite metrics database (``<checkpoint_dir>/training.db``) and its JSON exports.

:class:`TrainingDB` is a small library class: hydra-train writes through it while training and
hydra-diag reads through it. Rows are written as training goes and committed in batches
(:meth:`TrainingDB.commit`, called by the trainer at every log interval), in WAL mode, so a crash
loses at most the rows since the last commit. Each run is also exported to
``<checkpoint_dir>/diagnostics_{run_id}.json``; :func:`rebuild_database` recreates the database
from those files. A run resumed from a checkpoint logs the steps after it again: recording it drops
the rows its lineage logged after that step (:meth:`TrainingDB.drop_superseded`), and so does a
rebuild (the dead run's export still holds them).

The tables and their columns: :mod:`hydra_train.metrics_schema`.

EMAs of the training loss: short 0.99 (~100 steps), medium 0.999 (~1K), long 0.9999 (~10K),
bias-corrected, updated every optimizer step (not only at logged steps).
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra_train.metrics_schema import DB_NAME, EXPORT_FORMAT, SCHEMA, check_sqlite_file, connect, utc_now

__all__ = ["DB_NAME", "SCHEMA", "TrainingDB", "check_sqlite_file", "rebuild_database"]

_PER_RUN_TABLES = ("steps", "evals", "routing_mod", "routing_mor", "routing_moe", "adaptive_lr")
DEFAULT_MILESTONES = (9.0, 8.0, 7.0, 6.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.75, 2.5, 2.25, 2.0, 1.75, 1.5)
#: the runs with ``k``, their rank in start order, for the queries whose ties between runs go to the
#: later one: utc_time (an older version's rows hold local time) runs once a run, not once a row
_RUNS_BY_START = "(SELECT *, row_number() OVER (ORDER BY utc_time(started_at), rowid) AS k FROM runs)"


def _finite(x: Any) -> Any:
    """SQLite stores NaN as NULL anyway; make that explicit and keep JSON exports valid."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class TrainingDB:
    """Connection to one ``training.db``; safe to use as a context manager."""

    def __init__(self, path: str | Path, *, read_only: bool = False):
        """``read_only``: the caller only reads (db stats, hydra-diag); a file that is not already an
        SQLite database is then refused, a 0-byte one included, and nothing is written: a run
        copied read-only can be read, a live run's committed rows are (``metrics_schema.connect``)."""
        self.path = Path(path)
        check_sqlite_file(self.path, allow_empty=not read_only)
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = connect(self.path, read_only=read_only)

    # -- writing ------------------------------------------------------------------------------

    def _upsert(self, table: str, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self.conn.execute(
            f"INSERT OR REPLACE INTO {table} ({cols}) VALUES ({marks})", [_finite(v) for v in row.values()]
        )

    def _upsert_many(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self._upsert(table, row)

    def upsert_model(
        self, model_id: str, size: str, params: int, params_non_embedding: int, architecture: dict[str, Any]
    ) -> None:
        old = self.conn.execute("SELECT created_at FROM models WHERE model_id=?", (model_id,)).fetchone()
        self._upsert(
            "models",
            dict(
                model_id=model_id,
                size=size,
                params=int(params),
                params_non_embedding=int(params_non_embedding),
                architecture=json.dumps(architecture, sort_keys=True),
                created_at=old[0] if old else utc_now(),
            ),
        )
        self.conn.commit()

    def start_run(
        self,
        run_id: str,
        model_id: str,
        start_step: int,
        config: dict[str, Any],
        *,
        resumed_from: str | None = None,
        device: str = "",
        world_size: int = 1,
    ) -> None:
        """Record a new run; one that resumes ``resumed_from`` drops the rows it supersedes
        (:meth:`drop_superseded`)."""
        now = utc_now()
        self._upsert(
            "runs",
            dict(
                run_id=run_id,
                model_id=model_id,
                status="running",
                start_step=int(start_step),
                end_step=int(start_step),
                resumed_from=resumed_from,
                device=device,
                world_size=int(world_size),
                config=json.dumps(config, sort_keys=True, default=str),
                started_at=now,
            ),
        )
        if resumed_from is not None and start_step > 0:  # step 0: a weights-only start, no resume
            self.drop_superseded(resumed_from, start_step, before=now)
        self.conn.commit()

    def lineage(self, run_id: str, *, before: str | None = None) -> set[str]:
        """``run_id`` and every run linked to it through ``resumed_from`` (the runs it continued,
        the runs that continued it, and so on), among the runs started before ``before``."""
        # utc_time: an older version's rows hold local time without an offset (metrics_schema)
        where, params = ("", [])
        if before is not None:
            where, params = " WHERE utc_time(started_at) < utc_time(?)", [before]
        pairs = self.conn.execute(f"SELECT run_id, resumed_from FROM runs{where}", params).fetchall()
        found, size = {run_id}, 0
        while size != len(found):  # grow until no link adds a run
            size = len(found)
            found |= {b for a, b in pairs if b and a in found} | {a for a, b in pairs if b in found}
        return found

    def drop_superseded(self, resumed_from: str, step: int, *, before: str | None = None) -> None:
        """A run resuming ``resumed_from``'s checkpoint at ``step`` logs the steps after it again:
        drop the rows of every table that the runs of that lineage (:meth:`lineage`) logged after
        ``step``. Other runs of the model, in the same folder or not, keep theirs."""
        runs = sorted(self.lineage(resumed_from, before=before))
        marks = ", ".join("?" for _ in runs)
        for table in _PER_RUN_TABLES:
            self.conn.execute(
                f"DELETE FROM {table} WHERE step > ? AND run_id IN ({marks})", [int(step), *runs]
            )

    def log_step(self, run_id: str, step: int, **values: Any) -> None:
        aux = values.pop("aux", None)
        row = {"run_id": run_id, "step": int(step), **values}
        if aux is not None:
            row["aux"] = json.dumps({k: _finite(v) for k, v in aux.items()})
        self._upsert("steps", row)
        self.conn.execute("UPDATE runs SET end_step=max(end_step, ?) WHERE run_id=?", (int(step), run_id))

    def log_eval(self, run_id: str, step: int, val_loss: float) -> None:
        ppl = math.exp(val_loss) if math.isfinite(val_loss) and val_loss < 50 else None
        self._upsert("evals", dict(run_id=run_id, step=int(step), val_loss=val_loss, val_ppl=ppl))

    def log_lr(self, run_id: str, step: int, lr: float, base_lr: float, phase: str) -> None:
        factor = lr / base_lr if base_lr else None
        self._upsert(
            "adaptive_lr",
            dict(run_id=run_id, step=int(step), lr=lr, base_lr=base_lr, factor=factor, phase=phase),
        )

    def log_routing(self, run_id: str, step: int, stats: dict[str, list[dict[str, Any]]]) -> None:
        """Rows from ``routing_stats_to_python(model.routing_stats())``."""
        for s in stats.get("mod", []):
            frac = s.get("selected_frac")
            self._upsert(
                "routing_mod",
                dict(
                    run_id=run_id,
                    step=int(step),
                    layer=int(s["layer"]),
                    selected_frac=frac,
                    capacity=s.get("capacity"),
                    router_prob_mean=s.get("router_prob_mean"),
                    compute_savings=None if frac is None else 1.0 - float(frac),
                ),
            )
        for s in stats.get("mor", []):
            self._upsert(
                "routing_mor",
                dict(
                    run_id=run_id,
                    step=int(step),
                    layer=int(s["layer"]),
                    avg_depth=s.get("avg_depth"),
                    expected_depth=s.get("expected_depth"),
                    depth_hist=json.dumps(s.get("depth_hist")),
                ),
            )
        for s in stats.get("moe", []):
            self._upsert(
                "routing_moe",
                dict(
                    run_id=run_id,
                    step=int(step),
                    layer=int(s["layer"]),
                    entropy=s.get("entropy"),
                    utilization=json.dumps(s.get("utilization")),
                    kl_to_uniform=s.get("kl_to_uniform"),
                    max_violation=s.get("max_violation"),
                ),
            )

    def finish_run(self, run_id: str, status: str, **summary: Any) -> None:
        sets = {"status": status, "ended_at": utc_now(), **summary}
        cols = ", ".join(f"{k}=?" for k in sets)
        self.conn.execute(f"UPDATE runs SET {cols} WHERE run_id=?", [*map(_finite, sets.values()), run_id])
        self.conn.commit()

    def commit(self) -> None:
        self.conn.commit()

    def close(self) -> None:
        self.conn.commit()
        self.conn.close()

    def __enter__(self) -> TrainingDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------------------

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(sql, tuple(params)).fetchall()]

    def runs(self, model_id: str | None = None) -> list[dict[str, Any]]:
        where, params = ("WHERE model_id=?", [model_id]) if model_id else ("", [])
        return self.query(
            f"SELECT run_id, model_id, status, start_step, end_step, best_loss, best_val_loss, "
            "final_val_loss, "
            f"tokens_per_s, resumed_from, device, world_size, started_at, ended_at FROM runs {where} "
            "ORDER BY utc_time(started_at), rowid",
            params,
        )

    def model_ids(self) -> list[str]:
        return [r["model_id"] for r in self.query("SELECT model_id FROM models ORDER BY model_id")]

    def stats(self, model_id: str | None = None) -> list[dict[str, Any]]:
        """One summary row per model."""
        out = []
        for mid in [model_id] if model_id else self.model_ids():
            m = self.query("SELECT * FROM models WHERE model_id=?", [mid])
            agg = self.query(
                "SELECT count(DISTINCT s.run_id) AS runs, count(*) AS logged_steps, "
                "max(s.step) AS last_step, "
                "min(s.loss) AS best_loss, max(s.tokens_seen) AS tokens_seen FROM steps s JOIN runs r "
                "ON s.run_id=r.run_id WHERE r.model_id=?",
                [mid],
            )[0]
            last = self.query(
                "SELECT s.step, s.loss, s.ema_short, s.ema_medium, s.ema_long FROM steps s JOIN "
                f"{_RUNS_BY_START} r ON s.run_id=r.run_id WHERE r.model_id=? ORDER BY s.step DESC, r.k DESC "
                "LIMIT 1",
                [mid],
            )
            ev = self.query(
                "SELECT min(e.val_loss) AS best_val_loss FROM evals e JOIN runs r ON e.run_id=r.run_id "
                "WHERE r.model_id=?",
                [mid],
            )[0]
            row = {
                "model_id": mid,
                "params": m[0]["params"] if m else None,
                **agg,
                "best_val_loss": ev["best_val_loss"],
            }
            if last:
                row.update(
                    last_loss=last[0]["loss"],
                    ema_short=last[0]["ema_short"],
                    ema_medium=last[0]["ema_medium"],
                    ema_long=last[0]["ema_long"],
                )
            out.append(row)
        return out

    def milestones(
        self, model_id: str | None = None, thresholds: Iterable[float] = DEFAULT_MILESTONES
    ) -> list[dict[str, Any]]:
        """For each loss threshold: the first logged step whose short EMA went below it."""
        out = []
        for mid in [model_id] if model_id else self.model_ids():
            for t in thresholds:
                r = self.query(
                    "SELECT s.step, s.run_id, s.ema_short, s.tokens_seen FROM steps s JOIN runs r ON "
                    "s.run_id=r.run_id WHERE r.model_id=? AND s.ema_short<=? ORDER BY s.step LIMIT 1",
                    [mid, t],
                )
                if r:
                    out.append({"model_id": mid, "threshold": t, **r[0]})
        return out

    def ema(self, model_id: str | None = None, start: int = 0, limit: int = 0) -> list[dict[str, Any]]:
        """Loss and its three EMAs from step ``start`` on (``limit`` > 0 keeps that many, evenly spaced)."""
        where = "WHERE s.step>=?" + (" AND r.model_id=?" if model_id else "")
        params = [start, model_id] if model_id else [start]
        rows = self.query(
            "SELECT r.model_id, s.run_id, s.step, s.loss, s.ema_short, s.ema_medium, s.ema_long "
            f"FROM steps s "
            f"JOIN {_RUNS_BY_START} r ON s.run_id=r.run_id {where} ORDER BY r.model_id, s.step, r.k",
            params,
        )
        if limit and len(rows) > limit:
            stride = len(rows) / limit
            rows = [rows[int(i * stride)] for i in range(limit - 1)] + [rows[-1]]
        return rows

    # -- JSON export and rebuild --------------------------------------------------------------

    def export_run(self, run_id: str, path: str | Path) -> Path:
        """Everything the database holds about ``run_id``, as ``diagnostics_{run_id}.json``."""
        from hydra_train.atomic_files import atomic_write_bytes

        self.commit()
        run = self.query("SELECT * FROM runs WHERE run_id=?", [run_id])
        if not run:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        model = self.query("SELECT * FROM models WHERE model_id=?", [run[0]["model_id"]])
        doc: dict[str, Any] = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "model": model[0] if model else None,
            "run": run[0],
        }
        for table in _PER_RUN_TABLES:
            doc[table] = self.query(f"SELECT * FROM {table} WHERE run_id=? ORDER BY step", [run_id])
        p = Path(path)
        atomic_write_bytes(p, json.dumps(doc, indent=1).encode("utf-8"))
        return p

    def load_diagnostics_json(self, path: str | Path) -> str:
        """Insert (or replace) one exported run; returns its run id. A file that is not one
        (unreadable, not JSON, another format) raises ValueError naming it."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not valid JSON ({exc}); move it away and rebuild again") from None
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or "run" not in doc:
            raise ValueError(f"{path}: not a hydra-train diagnostics export; move it away and rebuild again")
        try:
            if doc.get("model"):
                self._upsert("models", doc["model"])
            self._upsert("runs", doc["run"])
            for table in _PER_RUN_TABLES:
                self._upsert_many(table, doc.get(table, []))
            run_id = doc["run"]["run_id"]
        except (sqlite3.Error, AttributeError, TypeError, KeyError) as exc:
            self.conn.rollback()
            msg = f"{path}: a damaged diagnostics export ({type(exc).__name__}: {exc}); move it away"
            raise ValueError(msg + " and rebuild again") from None
        self.commit()
        return run_id


def rebuild_database(folder: str | Path, db_name: str = DB_NAME) -> tuple[Path, list[str]]:
    """Recreate ``folder/training.db`` from every ``diagnostics_*.json`` there (atomic replace)."""
    import os

    folder = Path(folder)
    exports = sorted(folder.glob("diagnostics_*.json"))
    if not exports:
        raise FileNotFoundError(f"no diagnostics_*.json exports in {folder}")
    tmp = folder / f".{db_name}.rebuild"
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    run_ids = []
    try:
        with TrainingDB(tmp) as db:
            for p in exports:
                run_ids.append(db.load_diagnostics_json(p))
            # a dead run's export still holds the rows a later resume dropped: drop them again,
            # each resume over the runs started before it, as start_run did
            for r in db.query("SELECT resumed_from, start_step, started_at FROM runs WHERE start_step > 0"):
                if r["resumed_from"]:
                    db.drop_superseded(r["resumed_from"], r["start_step"], before=r["started_at"])
            db.commit()
            db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.conn.execute("PRAGMA journal_mode=DELETE")
    except BaseException:
        for suffix in ("", "-wal", "-shm"):  # the half-built copy goes; training.db is untouched
            Path(str(tmp) + suffix).unlink(missing_ok=True)
        raise
    target = folder / db_name
    for suffix in ("-wal", "-shm"):
        Path(str(target) + suffix).unlink(missing_ok=True)
    os.replace(tmp, target)
    return target, run_ids
