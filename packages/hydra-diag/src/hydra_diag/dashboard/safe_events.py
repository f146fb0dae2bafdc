"""SafeOptimizations for one run, as the dashboard shows it: what was requested, each
optimization's status, and the anomalies the monitor saw.

The database holds none of this; SafeOptimizations appends one JSON line per event (pretest
verdict, anomaly, disable, suspend, re-enable, graduate) to
``<checkpoint_dir>/pretest_logs/safe_opts_events.jsonl`` (hydra_train/safe_opts/pretest_log.py),
without a run id. A run's events are those stamped between its start and its end (or now, while
it runs; or the next run's start, for a killed run with no end); ``runs.started_at`` is written
just before the first pretest. Event and run times are UTC with an offset, an older version's
local time without one (the runs table's and the log's both): they are compared as UTC
(:func:`hydra_train.metrics_schema.utc_time`). The status is replayed from the events with the
same transitions as hydra_train/safe_opts/callback.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra_train.metrics_schema import utc_time

#: pretest verdict → status (callback._apply_verdicts); monitor action → status (callback._apply)
_VERDICT = {"PASS": "ENABLED", "N/A": "N/A", "FAIL": "FAILED"}
_ACTION = {"graduate": "STABLE", "disable": "DISABLED", "suspend": "SUSPENDED", "reenable": "ENABLED"}


def events_path(folder: Path) -> Path:
    from hydra_train.safe_opts.pretest_log import EVENTS

    return Path(folder) / "pretest_logs" / EVENTS


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of the event log (a line being appended right now is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def requested_optimizations(config: dict[str, Any]) -> list[str] | None:
    """Names of the optimizations the run's TrainConfig asks for (None when it cannot be read)."""
    try:
        from hydra_train.config import TrainConfig
        from hydra_train.safe_opts.registry import build_registry

        reg = build_registry(TrainConfig.from_dict(config))
        return [name for name, o in reg.items() if o.requested()]
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def _second(stamp: Any) -> str:
    """``stamp`` in UTC to the whole second (truncated), "" for none: event times have whole
    seconds, runs' have milliseconds, and either may be an older version's local time."""
    return str(utc_time(stamp, "seconds")) if stamp else ""


def _in_run(ev: dict[str, Any], run: dict[str, Any], next_start: str | None = None) -> bool:
    t, start, end = _second(ev.get("time")), _second(run.get("started_at")), _second(run.get("ended_at"))
    if not end and next_start:
        # no end time (a killed run: settle_dead_runs sets none): it ended before the next run of
        # the folder started (the folder lock), whose first pretests share that second
        return bool(t) and start <= t < _second(next_start)
    return bool(t) and t >= start and (not end or t <= end)


def safe_opts_report(
    folder: Path, run: dict[str, Any], config: dict[str, Any], next_start: str | None = None
) -> dict[str, Any]:
    """``requested``, ``status`` (name → {status, reason, step}), ``anomalies`` and ``events``.
    ``next_start``: when the database's next run started (None for the newest run)."""
    events = [ev for ev in read_events(events_path(folder)) if _in_run(ev, run, next_start)]
    requested = requested_optimizations(config)
    status: dict[str, dict[str, Any]] = {}
    for name in requested or []:
        why = "no verdict logged: not applicable on this device, or pretests skipped"
        status[name] = {"status": "REQUESTED", "reason": why, "step": None}
    anomalies = []
    for ev in events:
        kind, name = ev.get("event"), ev.get("name")
        if kind == "anomaly":
            anomalies.append({k: ev.get(k) for k in ("at_step", "kind", "name", "value", "baseline", "time")})
            continue
        new = _VERDICT.get(str(ev.get("status"))) if kind == "pretest" else _ACTION.get(str(kind))
        if name and new:
            status[name] = {"status": new, "reason": ev.get("reason") or "", "step": ev.get("step")}
    return {
        "requested": requested,
        "status": status,
        "anomalies": anomalies,
        "events": events[-200:],
        "log": str(events_path(folder).name),
    }
