"""Run artifacts: the helpers against hand counts, and a real attention fallback reaching the CSV."""

from __future__ import annotations

import csv
from datetime import datetime, timedelta, timezone

import torch

import hydra_model
from hydra_train.artifacts import (
    RunArtifacts,
    dtypes_report,
    environment,
    fallback_counters,
    optimizer_state_mb,
)


def test_optimizer_state_and_dtypes():
    m = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3, bias=False).to(torch.bfloat16))
    opt = torch.optim.AdamW(m[0].parameters())
    m[0](torch.randn(2, 10)).sum().backward()
    opt.step()
    n = 10 * 7 + 7
    # exp_avg + exp_avg_sq in fp32 for each parameter, plus one fp32 step counter per parameter
    assert optimizer_state_mb(opt) * 2**20 == 2 * n * 4 + 2 * 4
    rep = dtypes_report(m)
    assert "torch.float32" in rep and f"{n:,d}" in rep and f"{21:,d}" in rep and "0.weight" in rep


def test_attention_fallback_reaches_the_csv(tmp_path):
    hydra_model.reset_attention_fallback_counts()
    before = hydra_model.get_attention_backend()
    try:
        hydra_model.set_attention_backend("flash")  # not installed here: every call falls back to SDPA
        model = hydra_model.create_ccgqa_mod_mor_model("tiny", dim=64, vocab_size=64)
        model(torch.randint(0, 64, (1, 8)))
        rows = fallback_counters()
    finally:
        hydra_model.set_attention_backend(before)
        hydra_model.reset_attention_fallback_counts()
    attention = [r for r in rows if r[0] == "attention"]
    assert attention and all(n > 0 for _, _, n in attention)
    assert {r[1] for r in rows if r[0] == "kernel"} >= {"rms_norm", "swiglu", "linear_cross_entropy"}
    art = RunArtifacts(tmp_path)
    art.fallback_row(7)
    art.fallback_row(9)
    with open(tmp_path / "fallback_counters.csv") as f:
        got = list(csv.DictReader(f))
    assert {r["step"] for r in got} == {"7", "9"}
    totals = [r for r in got if r["name"] == "total_fallbacks"]
    assert len(totals) == 2 and all(int(t["count"]) >= 0 for t in totals)


def test_failed_routing_compile_is_a_reported_fallback(monkeypatch):
    from collections import Counter

    import hydra_model.fused_routing as fr

    counts = Counter({"gated_scatter:failed": 1, "gated_scatter:eager": 4, "router_logits:compiled": 9})
    monkeypatch.setattr(fr, "_counts", counts)
    rows = fallback_counters()
    assert [r for r in rows if r[0] == "routing"] == [("routing", "gated_scatter", 1)]


def test_env_json_time_is_utc_with_an_offset(nine_hours_east):
    """env.json's ``time`` (when the run started) reads next to the runs table's ``started_at``
    (UTC, metrics_schema.utc_now): UTC with its offset, not a local stamp 9 hours off."""
    before = datetime.now(timezone.utc)
    t = datetime.fromisoformat(environment(torch.device("cpu"), 1)["time"])
    assert t.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= t <= before + timedelta(seconds=5)
