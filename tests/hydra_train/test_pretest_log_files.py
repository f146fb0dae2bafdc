"""The pretest log files are standard JSON (a non-finite number is null), older files holding NaN
still read, and the event log's times are UTC like the runs table's they are matched with."""

from __future__ import annotations

import json
import math
import time
from datetime import datetime, timedelta, timezone

from hydra_train.safe_opts.pretest_log import EVENTS, HISTORY, PretestHook
from hydra_train.safe_opts.report import build_report


def _strict(text: str):
    """What jq or JavaScript reads: NaN and Infinity are errors."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _record(t="2026-01-10T10:00:00"):
    timing = {"median_ms": math.nan, "default_median_ms": 10.0, "speedup": math.inf}
    return {
        "time": t,
        "model_size": "100M",
        "fingerprint": "a",
        "env": {"device": "dev"},
        "results": {
            "fp8": {"status": "FAIL", "reason": "loss not finite", "max_diff": -math.inf, "timing": timing}
        },
    }


def test_records_are_written_with_null_for_non_finite_numbers(tmp_path):
    hook = PretestHook(tmp_path / "logs", shared_dir=tmp_path / "shared")
    day = hook.record(_record())
    shared = hook.share(_record())
    for path in (tmp_path / "logs" / HISTORY, day, shared):
        res = _strict(path.read_text())
        res = res[0] if isinstance(res, list) else res
        fp8 = res["results"]["fp8"]
        assert fp8["max_diff"] is None and fp8["timing"] == {
            "median_ms": None,
            "default_median_ms": 10.0,
            "speedup": None,
        }


def test_events_are_written_with_null_for_non_finite_numbers(tmp_path):
    hook = PretestHook(tmp_path)
    hook.log_event({"event": "anomaly", "name": "fp8", "loss": math.nan, "grad_norm": math.inf})
    line = (tmp_path / EVENTS).read_text().splitlines()[0]
    ev = _strict(line)
    assert ev["loss"] is None and ev["grad_norm"] is None


def test_older_files_holding_nan_still_read(tmp_path):
    old = json.dumps([_record()], indent=1)  # how the logs were written before: NaN, Infinity
    assert "NaN" in old and "Infinity" in old
    (tmp_path / HISTORY).write_text(old)
    (tmp_path / EVENTS).write_text('{"time": "2026-01-10T10:00:00", "event": "anomaly", "loss": NaN}\n')
    hook = PretestHook(tmp_path)
    assert hook.decide("a", "100M", None, needed=["fp8"]) == (None, hook.get_history()[0])
    assert math.isnan(hook.get_history()[0]["results"]["fp8"]["timing"]["median_ms"])
    assert hook.get_summary()["100M"]["fp8"]["status"] == "FAIL"
    assert math.isnan(hook.events()[0]["loss"])
    hook.record(_record("2026-01-11T10:00:00"))  # appending rewrites the history: standard JSON now
    assert [r["results"]["fp8"]["max_diff"] for r in _strict((tmp_path / HISTORY).read_text())] == [
        None,
        None,
    ]
    assert "| fp8 | FAIL |" in build_report(hook.get_history())  # the report reads both


def test_event_times_are_utc_like_the_runs_table(tmp_path, nine_hours_east):
    """The dashboard gives a run the events stamped between its ``started_at`` and ``ended_at``
    (UTC): an event stamped in local time (SafeOptimizations' own stamp) is written in UTC."""
    hook = PretestHook(tmp_path)
    before = datetime.now(timezone.utc)
    hook.log_event({"event": "graduate", "name": "fa3"})  # no time: stamped now
    hook.log_event({"time": "2026-01-10T19:00:00", "event": "disable", "name": "fp8"})  # local
    hook.log_event({"time": "2026-01-10T01:00:00+00:00", "event": "suspend", "name": "fp8"})
    now, local, utc = (ev["time"] for ev in hook.events())
    assert before - timedelta(seconds=1) <= datetime.fromisoformat(now) <= before + timedelta(seconds=5)
    assert now.endswith("+00:00")
    assert local == "2026-01-10T10:00:00+00:00" and utc == "2026-01-10T01:00:00+00:00"


def test_the_dashboard_gives_a_run_the_events_logged_while_it_ran(tmp_path, nine_hours_east):
    """The event log and the runs table meet in hydra-diag's dashboard: an event SafeOptimizations
    stamps in local time while a run runs is that run's, 9 hours from UTC too."""
    from hydra_diag.dashboard.safe_events import safe_opts_report
    from hydra_train.metrics_db import TrainingDB

    hook = PretestHook(tmp_path / "pretest_logs")
    with TrainingDB(tmp_path / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {})
        db.start_run("r1", "tiny", 0, {})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")  # local, as an older callback.py stamped an event
        hook.log_event({"time": stamp, "step": 0, "event": "pretest", "name": "compile", "status": "PASS"})
        db.finish_run("r1", "finished")
        run = db.runs()[0]
    report = safe_opts_report(tmp_path, run, {}, None)
    assert [e["event"] for e in report["events"]] == ["pretest"]
    assert report["status"]["compile"]["status"] == "ENABLED"
