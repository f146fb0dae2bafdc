"""collect_by_seq.py: shards regrouped by sequence length, every row kept in order, trainable as is."""

from __future__ import annotations

import json

import torch

from hydra_train.data_sources import load_data

from .conftest import invoke, last_error_line, run_json


def _shards(folder):
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 300, (5, 18), generator=g)
    b = torch.randint(0, 300, (7, 34), generator=g)
    c = torch.randint(0, 300, (4, 18), generator=g)
    s = torch.randint(0, 300, (500,), generator=g)
    torch.save({"input_ids": a}, folder / "p0.pt")
    torch.save({"input_ids": b}, folder / "p1.pt")
    torch.save({"input_ids": c}, folder / "p2.pt")
    torch.save(s, folder / "stream.pt")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 300}))
    return a, b, c, s


def test_groups_by_length_and_keeps_rows(runner, tmp_path):
    a, _, c, s = _shards(tmp_path / "in")
    out = run_json(
        runner,
        ["convert", "collect-by-seq", tmp_path / "in", "--out", tmp_path / "out", "--rows_per_shard", 6],
    )
    groups = out["groups"]
    assert set(groups) == {"seq_17", "seq_33", "stream"}
    assert groups["seq_17"]["rows"] == 9 and groups["seq_33"]["rows"] == 7
    got17 = torch.cat([torch.load(p, weights_only=True)["input_ids"] for p in groups["seq_17"]["shards"]])
    assert torch.equal(got17, torch.cat([a, c]))  # input order, nothing lost
    assert [torch.load(p, weights_only=True)["input_ids"].shape[0] for p in groups["seq_17"]["shards"]] == [
        6,
        3,
    ]
    assert torch.equal(torch.load(groups["stream"]["shards"][0], weights_only=True), s)
    data = load_data(str(tmp_path / "out" / "seq_33"), seq_len=1, vocab_size=None, default_vocab=32000)
    assert data.seq_len == 33 and data.vocab_size == 300  # meta.json was copied beside
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["groups"]["seq_33"]["rows"] == 7


def test_refuses_a_non_empty_output_and_bad_shards(runner, tmp_path):
    _shards(tmp_path / "in")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    res = invoke(runner, ["convert", "collect-by-seq", tmp_path / "in", "--out", tmp_path / "busy"])
    assert res.exit_code == 1 and "not empty" in last_error_line(res)
    torch.save({"weights": torch.zeros(3, 3)}, tmp_path / "in" / "zz.pt")
    res = invoke(runner, ["convert", "collect-by-seq", tmp_path / "in", "--out", tmp_path / "o2"])
    assert res.exit_code == 1 and "zz.pt" in last_error_line(res)
