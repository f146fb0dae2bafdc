"""PretestHook: rerun rule, the log files, history, summary."""

from __future__ import annotations

import json

import torch
from rich.console import Console

from hydra_train.config import TrainConfig
from hydra_train.safe_opts.pretest_log import HISTORY, PretestHook, environment, fingerprint


def rec(size, fp, checkpoint=None, results=None, t="2026-01-10T10:00:00+00:00"):
    # stamps with the offset: a day file is named by the UTC date whatever the zone the tests run in
    return {
        "model_size": size,
        "fingerprint": fp,
        "checkpoint": checkpoint,
        "time": t,
        "env": {"device": "dev"},
        "results": results or {},
    }


def test_rerun_rule(tmp_path):
    hook = PretestHook(tmp_path)
    assert hook.decide("a", "100M", None) == ("first run", None)
    hook.record(rec("100M", "a"))
    trigger, cached = hook.decide("a", "100M", None)
    assert trigger is None and cached["fingerprint"] == "a"  # same fingerprint: reuse
    assert hook.decide("b", "100M", None)[0] == "config changed"
    assert hook.decide("b", "100M", "ck.pt@60")[0] == "new checkpoint loaded (ck.pt@60)"
    assert hook.decide("c", "500M", None)[0] == "model size changed (100M -> 500M)"


def test_fingerprint_sees_config_checkpoint_and_device():
    env = environment(torch.device("cpu"))
    m = {"dim": 64}
    base = fingerprint(m, TrainConfig(), env, None)
    assert base == fingerprint(m, TrainConfig(), env, None)
    assert base != fingerprint(m, TrainConfig(batch_size=3), env, None)
    assert base != fingerprint(m, TrainConfig(compile=True), env, None)
    assert base != fingerprint(m, TrainConfig(), env, "ck@1")
    assert base != fingerprint({"dim": 65}, TrainConfig(), env, None)
    assert base != fingerprint(m, TrainConfig(), {**env, "device": "other"}, None)
    assert set(env["optional"]) == {"bitsandbytes", "flash-attn", "flash_attn_3", "xformers"}
    other_bnb = {**env, "optional": {**env["optional"], "bitsandbytes": "0.0.1-test"}}
    assert base != fingerprint(m, TrainConfig(), other_bnb, None)
    assert base == fingerprint(m, TrainConfig(max_steps=7, lr=1.0), env, None)  # not what a pretest measures


def test_files_history_and_summary(tmp_path):
    hook = PretestHook(tmp_path)
    ok = {"status": "PASS", "reason": None, "timing": {"speedup": 1.4}}
    bad = {"status": "FAIL", "reason": "slower", "timing": {"speedup": 0.8}}
    hook.record(rec("100M", "a", results={"compile": ok, "fa3": ok}, t="2026-01-10T10:00:00+00:00"))
    hook.record(rec("100M", "b", results={"compile": bad}, t="2026-01-10T11:00:00+00:00"))
    day = hook.record(
        rec("1B", "c", results={"fa3": {"status": "N/A", "reason": "no"}}, t="2026-01-11T09:00:00+00:00")
    )
    assert day.name == "pretest_1B_2026-01-11.json"
    assert len(json.loads((tmp_path / HISTORY).read_text())) == 3
    assert len(json.loads((tmp_path / "pretest_100M_2026-01-10.json").read_text())) == 2
    assert [r["fingerprint"] for r in hook.get_history(model_size="100M")] == ["a", "b"]
    summ = hook.get_summary()
    assert summ["100M"]["compile"]["status"] == "FAIL" and summ["100M"]["compile"]["counts"] == {
        "PASS": 1,
        "FAIL": 1,
    }
    assert summ["1B"]["fa3"]["status"] == "N/A"
    con = Console(record=True, width=200)
    hook.print_summary(con)
    text = con.export_text()
    assert "compile" in text and "1/1/0" in text and "slower" in text


def test_events(tmp_path):
    hook = PretestHook(tmp_path)
    hook.log_event({"event": "disable", "name": "fp8"})
    hook.log_event({"event": "graduate", "name": "fa3"})
    assert [e["event"] for e in hook.events()] == ["disable", "graduate"]
