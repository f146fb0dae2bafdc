"""SafeOptimizations' times: the callback stamps its events in UTC as the event log holds them,
and the OPTIMIZATIONS.md report takes the latest pretest record by time, whether a record's stamp
is local without an offset or carries one."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from hydra_train.config import TrainConfig
from hydra_train.safe_opts.callback import SafeOptimizations
from hydra_train.safe_opts.pretest_log import PretestHook
from hydra_train.safe_opts.report import build_report


def test_the_callback_keeps_its_events_with_the_logs_utc_time(tmp_path, nine_hours_east):
    """The events the callback keeps (and puts into checkpoints) read as the log's: UTC with the
    offset, not a local stamp the log converts on the way."""
    safe = SafeOptimizations(TrainConfig(), log_dir=tmp_path, log=lambda msg: None)
    before = datetime.now(timezone.utc)
    safe._event("graduate", name="fa3")
    kept, logged = safe.events[-1], PretestHook(tmp_path).events()[-1]
    assert kept == logged
    t = datetime.fromisoformat(kept["time"])
    assert t.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= t <= before + timedelta(seconds=5)
    assert safe.state_dict()["events"][-1]["time"] == logged["time"]


def _record(stamp: str, key: str, warmup: int) -> dict:
    return {
        "time": stamp,
        "model_size": "100M",
        "env": {"device": "dev"},
        "settings": {"warmup_steps": warmup, "steps": 10},
        "results": {key: {"status": "PASS"}},
    }


def test_the_report_takes_the_latest_record_by_time_not_by_text(nine_hours_east):
    """Settings row of a size: the latest of its records. 19:00 local (no offset) is 10:00 UTC,
    before 12:00 UTC, although its text sorts after it."""
    old = _record("2026-01-10T19:00:00", "fp8", warmup=1)
    new = _record("2026-01-10T12:00:00+00:00", "compile", warmup=2)
    for records in ([old, new], [new, old]):
        (row,) = [line for line in build_report(records).splitlines() if line.startswith("| 100M |")]
        assert "| 2 + 10 |" in row and row.endswith("| 2026-01-10T12:00:00+00:00 |"), row


def test_records_are_utc_and_filed_by_their_utc_date(tmp_path, nine_hours_east):
    """A record's ``time`` is UTC with its offset and its day file is named by the UTC date: a
    stamp without an offset is local (as older versions wrote them), and 03:00 in Tokyo is 18:00
    UTC the day before. A record stamped now carries the offset too."""
    hook = PretestHook(tmp_path)
    old_day = hook.record(_record("2026-01-11T03:00:00", "fp8", warmup=1))
    before = datetime.now(timezone.utc)
    new_day = hook.record({k: v for k, v in _record("", "compile", warmup=2).items() if k != "time"})
    old, new = hook.get_history()
    assert old["time"] == "2026-01-10T18:00:00+00:00" and old_day.name == "pretest_100M_2026-01-10.json"
    t = datetime.fromisoformat(new["time"])
    assert t.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= t <= before + timedelta(seconds=5)
    assert new_day.name == f"pretest_100M_{t.date()}.json"
    assert [r["time"] for r in json.loads(new_day.read_text())][-1] == new["time"]
