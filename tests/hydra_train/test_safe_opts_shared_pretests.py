"""Pretest verdicts shared by the runs of one machine ($HYDRA_CACHE_DIR/pretests): a new checkpoint
folder with the same fingerprint reuses them, anything that changes the fingerprint (the code
included) pretests again, and a record that cannot be read is pretested over, not trusted."""

from __future__ import annotations

import json
import sys

from hydra_train.run import run_training
from hydra_train.safe_opts import pretest_log
from hydra_train.safe_opts.callback import SafeOptimizations
from hydra_train.safe_opts.pretest_log import HISTORY, PretestHook

from .conftest import tiny_config


def rec(fp: str, t: str = "2026-01-10T10:00:00") -> dict:
    return {"model_size": "100M", "fingerprint": fp, "time": t, "results": {"fa3": {"status": "PASS"}}}


def test_a_new_folder_reuses_the_machines_record(tmp_path):
    shared = tmp_path / "machine"
    first = PretestHook(tmp_path / "a", shared)
    assert first.decide("f1", "100M", None) == ("first run", None)
    first.record(rec("f1"))
    assert first.share(rec("f1")) == shared / "f1.json"
    second = PretestHook(tmp_path / "b", shared)
    trigger, cached = second.decide("f1", "100M", None)
    assert trigger is None and cached["results"] == {"fa3": {"status": "PASS"}}
    assert cached["reused_from"] == str(shared / "f1.json") and cached["machine_record"]
    assert second.decide("f2", "100M", None) == ("first run", None)  # another fingerprint
    assert second.decide("f1", "100M", None, reuse_shared=False) == ("first run", None)
    assert PretestHook(tmp_path / "c").decide("f1", "100M", None) == ("first run", None)  # none shared


def test_a_machine_record_that_failed_on_speed_is_measured_again(tmp_path):
    shared = tmp_path / "machine"
    slow = {"status": "FAIL", "reason": "slower: 129.4 ms vs 121.3 ms per step (+7%, margin 5%)"}
    PretestHook(tmp_path / "a", shared).share({**rec("f1"), "results": {"fa3": slow}})
    trigger, cached = PretestHook(tmp_path / "b", shared).decide("f1", "100M", None)
    assert cached is None and trigger == "the machine's record failed fa3 on speed; pretesting again"
    broken = {"status": "FAIL", "reason": "error: RuntimeError: no kernel"}  # not a speed verdict: kept
    PretestHook(tmp_path / "a", shared).share({**rec("f2"), "results": {"fa3": broken}})
    assert PretestHook(tmp_path / "b", shared).decide("f2", "100M", None)[1]["results"] == {"fa3": broken}


def test_a_damaged_or_foreign_record_is_pretested_over(tmp_path):
    shared = tmp_path / "machine"
    shared.mkdir()
    (shared / "f1.json").write_text('{"fingerprint": "f1", "resu')
    trigger, cached = PretestHook(tmp_path / "a", shared).decide("f1", "100M", None)
    assert cached is None and "unreadable" in trigger and str(shared / "f1.json") in trigger
    wrong_results = ({**rec("f1"), "results": ["PASS"]}, {**rec("f1"), "results": {"fa3": 1}})
    for foreign in (rec("other"), [1, 2], *wrong_results):
        (shared / "f1.json").write_text(json.dumps(foreign))
        trigger, cached = PretestHook(tmp_path / "a", shared).decide("f1", "100M", None)
        assert cached is None and "not a pretest record of f1" in trigger, foreign


def test_the_source_hash_follows_the_code(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "fake_hydra_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "op.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(pretest_log, "SOURCE_PACKAGES", ("fake_hydra_pkg",))
    pretest_log.source_hash.cache_clear()
    try:
        before = pretest_log.source_hash()
        (pkg / "sub" / "op.py").write_text("X = 2\n")  # an edit deep in the package
        pretest_log.source_hash.cache_clear()
        edited = pretest_log.source_hash()
        (pkg / "sub" / "op.py").rename(pkg / "sub" / "op2.py")  # same bytes, another file
        pretest_log.source_hash.cache_clear()
        renamed = pretest_log.source_hash()
    finally:
        pretest_log.source_hash.cache_clear()
        sys.modules.pop("fake_hydra_pkg", None)
    assert len({before, edited, renamed}) == 3


def _cfg(data, ck, **kw):
    # prefetch threads and static routing are pretested on a CPU
    base = dict(max_steps=3, save_every=100, static_routing_mode=True, experimental_prefetch_threads=2)
    return tiny_config(data, ck, **{**base, **kw})


def _history(ck) -> list[dict]:
    return json.loads((ck / "pretest_logs" / HISTORY).read_text())


def test_hydra_train_run_shares_its_verdicts_with_the_next_run(bin_dataset, tmp_path):
    """Through run_training itself (the wiring ``hydra-train run`` uses)."""
    machine = pretest_log.shared_pretest_dir()  # this test's own folder (tests/conftest.py)
    s1 = run_training(_cfg(bin_dataset, tmp_path / "a"))
    (first,) = _history(tmp_path / "a")
    assert "reused_from" not in first and first["trigger"] == "first run"
    shared = json.loads((machine / f"{first['fingerprint']}.json").read_text())
    assert shared["results"] == first["results"] and shared["time"] == first["time"] is not None

    s2 = run_training(_cfg(bin_dataset, tmp_path / "b"))
    (second,) = _history(tmp_path / "b")
    assert second["reused_from"] == str(machine / f"{first['fingerprint']}.json")
    assert second["recorded"] == first["time"] and second["results"] == first["results"]
    assert second["trigger"] == "reused (machine)" and "machine_record" not in second
    assert s2["safe_opts"] == s1["safe_opts"]

    # a fresh start in that folder reuses its copy without copying it again; without reuse it
    # pretests, the copy notwithstanding
    run_training(_cfg(bin_dataset, tmp_path / "b", resume=False))
    assert len(_history(tmp_path / "b")) == 1
    run_training(_cfg(bin_dataset, tmp_path / "b", resume=False, reuse_pretests=False))
    hist_b = _history(tmp_path / "b")
    assert len(hist_b) == 2 and "reused_from" not in hist_b[-1]

    run_training(_cfg(bin_dataset, tmp_path / "c", reuse_pretests=False))
    (third,) = _history(tmp_path / "c")
    assert "reused_from" not in third and third["time"] >= first["time"] and third["trigger"] == "first run"

    run_training(_cfg(bin_dataset, tmp_path / "d", batch_size=2))  # another fingerprint
    (fourth,) = _history(tmp_path / "d")
    assert "reused_from" not in fourth and fourth["fingerprint"] != first["fingerprint"]


def test_the_log_says_where_the_verdicts_came_from(bin_dataset, tmp_path):
    machine = tmp_path / "machine"
    logs: list[list[str]] = []
    for folder in ("a", "b"):
        logs.append([])
        cfg = _cfg(bin_dataset, tmp_path / folder)
        run_training(cfg, callbacks=[SafeOptimizations(cfg, shared_dir=machine, log=logs[-1].append)])
    assert any(m.startswith("[SafeOpts] pretest arm default: ") for m in logs[0])
    assert not any(m.startswith("[SafeOpts] pretest arm ") for m in logs[1])  # no arm ran again
    reused = [m for m in logs[1] if "reusing its verdicts" in m]
    assert len(reused) == 1 and str(machine) in reused[0] and "--no-reuse_pretests" in reused[0]
    assert "a run of None" not in reused[0]  # the shared record carries its time
