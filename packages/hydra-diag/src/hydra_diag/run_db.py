"""Reading one run out of hydra-train's metrics database (through :class:`TrainingDB`).

A run is found by its id, or is the most recently started run (of ``model`` when given). The
path may be the database file or the checkpoint folder that holds ``training.db``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_diag.output import DiagError

if TYPE_CHECKING:
    from hydra_model import GPTConfig, HydraConfig


def db_path(path: str | Path) -> Path:
    """The metrics database behind ``path`` (the file, or ``path/training.db``), checked to be
    hydra-train's (:func:`check_metrics_file`)."""
    from hydra_train.metrics_db import DB_NAME

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / DB_NAME
    if not p.is_file():
        raise DiagError(
            f"no metrics database at {p}; pass a checkpoint folder holding {DB_NAME} (hydra-train run "
            "--checkpoint_dir) or the database file itself"
        )
    check_metrics_file(p)
    return p


def check_metrics_file(p: Path) -> None:
    """A DiagError unless ``p`` is an SQLite file with hydra-train's tables: hydra-train's
    read-only connection refuses another program's SQLite file (metrics_schema.foreign_database),
    and reads an older one's missing tables as empty ones."""
    from hydra_train.errors import HydraDataError
    from hydra_train.metrics_schema import check_sqlite_file, connect

    try:
        check_sqlite_file(p, allow_empty=False)
        connect(p, read_only=True).close()
    except HydraDataError as exc:
        raise DiagError(str(exc)) from None


def check_hydra_tables(p: Path, tables: set[str]) -> None:
    """A DiagError when the database ``p`` holds tables but none of hydra-train's (an empty one is
    a run that has not written yet: its callers say so)."""
    from hydra_train.metrics_schema import foreign_database

    foreign = foreign_database(p, tables)
    if foreign is not None:
        raise DiagError(foreign)


@dataclass
class RunData:
    """Everything the analyses need about one run, as plain rows."""

    run: dict[str, Any]
    model: dict[str, Any] | None
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    lr: list[dict[str, Any]]
    routing_moe: list[dict[str, Any]] = field(default_factory=list)
    train_config: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run["run_id"]

    @property
    def arch(self) -> str:
        """The architecture the run trained: its train config's ``arch`` (runs recorded before
        ``--arch`` existed trained HYDRA, hydra_model.architectures.DEFAULT_ARCH)."""
        from hydra_model.architectures import DEFAULT_ARCH

        return self.train_config.get("arch") or DEFAULT_ARCH

    def architecture_config(self) -> HydraConfig | GPTConfig | None:
        """The config of the model the run trained, of its arch's class (HydraConfig, GPTConfig),
        or None when the models row is missing; a DiagError when the recorded architecture is not
        one of that arch."""
        from hydra_model.architectures import config_from_dict

        if not self.model or not self.model.get("architecture"):
            return None
        try:
            return config_from_dict(self.arch, json.loads(self.model["architecture"]))
        except (ValueError, TypeError) as exc:
            raise DiagError(
                f"run {self.run_id}: the model {self.model.get('model_id')!r} recorded in its database is "
                f"not a {self.arch} model config ({exc})"
            ) from None

    def model_config(self) -> HydraConfig | None:
        """The run's HydraConfig, or None for a run of another architecture (the dense GPT has no
        routing, MoE or auxiliary terms to analyse) or without a models row. Use
        :meth:`architecture_config` for the config of any architecture. A recorded config this
        hydra-model cannot read (another version's fields) is None too: its callers (the MoE
        watchdog, the loss components) go on without it, as they did."""
        if self.arch != "hydra":
            return None
        try:
            return self.architecture_config()
        except DiagError:
            return None


def pick_run(db, run_id: str | None, model: str | None) -> dict[str, Any]:
    runs = db.runs(model)
    if not runs:
        raise DiagError(f"{db.path} holds no runs" + (f" of model {model!r}" if model else ""))
    if run_id is None:
        return runs[-1]
    for r in runs:
        if r["run_id"] == run_id:
            return r
    raise DiagError(f"no run {run_id!r} in {db.path}; runs there: {', '.join(r['run_id'] for r in runs)}")


def load_run(path: str | Path, run_id: str | None = None, model: str | None = None) -> RunData:
    """The steps, evaluations and learning-rate rows of one run, ordered by step."""
    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(db_path(path), read_only=True) as db:
        run = pick_run(db, run_id, model)
        rid = run["run_id"]
        full = db.query("SELECT * FROM runs WHERE run_id=?", [rid])[0]
        mrow = db.query("SELECT * FROM models WHERE model_id=?", [run["model_id"]])
        steps = db.query("SELECT * FROM steps WHERE run_id=? ORDER BY step", [rid])
        evals = db.query("SELECT * FROM evals WHERE run_id=? ORDER BY step", [rid])
        lr = db.query("SELECT * FROM adaptive_lr WHERE run_id=? ORDER BY step", [rid])
        moe = db.query("SELECT * FROM routing_moe WHERE run_id=? ORDER BY step, layer", [rid])
    for s in steps:
        s["aux"] = json.loads(s["aux"]) if s.get("aux") else {}
    for m in moe:
        m["utilization"] = json.loads(m["utilization"]) if m.get("utilization") else []
    try:
        tc = json.loads(full.get("config") or "{}")
    except json.JSONDecodeError:
        tc = {}
    return RunData(full, mrow[0] if mrow else None, steps, evals, lr, moe, tc)
