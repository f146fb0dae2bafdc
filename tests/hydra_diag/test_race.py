"""``hydra-diag race`` end to end on the CPU: two tiny configurations raced through the CLI on a real
standard-library subset, the JSON checked field by field, the PNGs, the tables, and ``race merge``
(the same runs split and merged back; mismatched runs refused, naming the field)."""

from __future__ import annotations

import copy
import json
import math
import sysconfig
from pathlib import Path

import pytest

from tests.hydra_diag.conftest import _one_thread_reference_kernels, assert_png, invoke

STD = Path(sysconfig.get_paths()["stdlib"])
#: real standard-library packages, 0.8 MB: small, and two of their files hash into validation
STD_PACKAGES = ("json", "email", "logging", "importlib")
BUDGET, EVALS, B, T = 2.0, 2, 4, 32
TINY_SETS = [
    "--set",
    "gpt.dim=64",
    "--set",
    "gpt.head_dim=16",
    "--set",
    "gpt.mlp_hidden=128",
    "--set",
    "hydra.dim=64",
    "--set",
    "*.max_seq_len=64",
]


def tiny_race_args(data, json_path, budget: float = 0.5) -> list:
    """``race run`` of the gpt and hydra at the tiny preset on ``data`` (a bigram dataset), one
    evaluation, ``--json json_path``: a race of a second or so on the CPU."""
    return [
        "race", "run", "--configs", "gpt,hydra", "--model-size", "tiny", "--budget", budget, "--evals", 1,
        "--seq-len", 16, "--batch-size", 4, "--val-windows", 4, "--vocab-size", 256,
        "--dataset", data, *TINY_SETS, "--json", json_path, "--quiet",
    ]  # fmt: skip


def race_args(out: Path, *extra: str) -> list[str]:
    return [
        "race",
        "run",
        "--configs",
        "gpt,hydra",
        "--model-size",
        "tiny",
        "--budget",
        BUDGET,
        "--evals",
        EVALS,
        "--seq-len",
        T,
        "--batch-size",
        B,
        "--val-windows",
        6,
        "--vocab-size",
        400,
        "--lr",
        3e-3,
        *[a for pkg in STD_PACKAGES for a in ("--corpus-root", STD / pkg)],
        *TINY_SETS,
        "--log-every",
        0.5,
        "--json",
        out / "race.json",
        "--plots",
        out,
        *extra,
    ]


@pytest.fixture(scope="module")
def raced(tmp_path_factory, runner):
    if not all((STD / pkg).is_dir() for pkg in STD_PACKAGES):
        pytest.skip("this interpreter ships without the standard library's sources")
    _one_thread_reference_kernels()  # module fixtures run before the per-test autouse one
    out = tmp_path_factory.mktemp("race")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYDRA_CACHE_DIR", str(out / "cache"))
    try:
        res = invoke(runner, race_args(out))
    finally:
        mp.undo()
    return res, out, json.loads((out / "race.json").read_text())


def test_race_json(raced):
    res, _, doc = raced
    assert res.exit_code == 0, res.output
    assert doc["kind"] == "hydra-diag race"
    s = doc["settings"]
    assert (s["budget_s"], s["evals"], s["seq_len"], s["batch_size"], s["model_size"]) == (
        BUDGET,
        EVALS,
        T,
        B,
        "tiny",
    )
    assert s["betas"] == [0.9, 0.95] and s["weight_decay"] == 0.1
    env = doc["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["date"].endswith("UTC")
    assert env["command"].startswith("hydra-diag ")  # sys.argv: the real command line outside tests
    d = doc["data"]
    assert d["name"] == "pyenv" and d["files"]["train"] > 0 and d["files"]["val"] > 0
    assert d["tokens"]["train"] > d["tokens"]["val"] > 0 and d["vocab_size"] <= 400
    assert len(d["train_digest"]) == 16 and d["train_digest"] != d["val_digest"]
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["gpt", "hydra"]
    for r in runs.values():
        assert r["status"] == "ok" and r["compile"] == "none" and r["lr"] == 3e-3
        assert r["params"] > 0 and r["flops_per_token"] > 0 and r["setup_s"] > 0
        assert r["steps"] >= 1 and r["tokens"] == r["steps"] * B * T
        assert r["train_s"] >= BUDGET and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["train_s"])
        assert r["epochs"] == pytest.approx(r["steps"] * B / d["train_windows"])
        evals = r["evals"]
        assert len(evals) == EVALS + 1 and evals[0]["elapsed_s"] == 0 and evals[0]["steps"] == 0
        times = [e["elapsed_s"] for e in evals]
        assert times == sorted(times) and len(set(times)) == len(times)
        for i, e in enumerate(evals[1:], 1):
            assert e["elapsed_s"] >= BUDGET * i / EVALS  # an evaluation waits for its mark
            assert e["tokens"] == e["steps"] * B * T and e["flops"] == pytest.approx(
                e["tokens"] * r["flops_per_token"]
            )
        for e in evals:
            assert math.isfinite(e["val_loss"]) and 0 < e["val_loss"] < 10
        # an untrained model's loss is about ln V; training at lr 3e-3 lowers it
        assert evals[0]["val_loss"] == pytest.approx(math.log(d["vocab_size"]), abs=0.5)
        assert r["final_val_loss"] == evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert runs["hydra"]["routed"] and not runs["gpt"]["routed"]
    assert all(math.isfinite(e["val_loss_train_mode"]) for e in runs["hydra"]["evals"])
    assert all(e["val_loss_train_mode"] is None for e in runs["gpt"]["evals"])
    assert runs["hydra"]["final_val_loss_train_mode"] == runs["hydra"]["evals"][-1]["val_loss_train_mode"]


def test_race_pngs_and_table(raced):
    res, out, doc = raced
    from PIL import Image

    for name in ("time", "tokens", "flops"):
        p = out / f"race_loss_vs_{name}.png"
        assert_png(p)
        with Image.open(p) as im:
            colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colours) > 50  # axes, text and two coloured lines, not a blank canvas
    assert doc["plots"] == [str(out / f"race_loss_vs_{n}.png") for n in ("time", "tokens", "flops")]
    text = res.stdout
    assert "GF/tok" in text and "train-mode" in text and "gpt" in text and "hydra" in text
    assert "status" not in text  # only shown when a run failed
    table_lines = [ln for ln in text.splitlines() if not ln.startswith(("plot:", "json:"))]
    assert max(len(ln) for ln in table_lines) <= 80


def _split(doc: dict, name: str) -> dict:
    part = copy.deepcopy(doc)
    part["runs"] = [r for r in doc["runs"] if r["name"] == name]
    return part


def test_merge_roundtrip_and_refusals(raced, tmp_path, runner):
    _, _, doc = raced
    a, b = tmp_path / "gpt.json", tmp_path / "hydra.json"
    a.write_text(json.dumps(_split(doc, "gpt")))
    b.write_text(json.dumps(_split(doc, "hydra")))
    res = invoke(runner, ["race", "merge", a, b, "--json", tmp_path / "all.json", "--plots", tmp_path / "p"])
    assert res.exit_code == 0, res.output
    merged = json.loads((tmp_path / "all.json").read_text())
    assert [r["name"] for r in merged["runs"]] == ["gpt", "hydra"]
    for got, want in zip(merged["runs"], doc["runs"], strict=True):
        assert {k: v for k, v in got.items() if k != "source"} == want
    assert [m["file"] for m in merged["merged_from"]] == [str(a), str(b)]
    assert_png(tmp_path / "p" / "race_loss_vs_flops.png")

    other = _split(doc, "hydra")
    other["settings"]["budget_s"] = 600.0
    b.write_text(json.dumps(other))
    res = invoke(runner, ["race", "merge", a, b])
    assert res.exit_code == 1 and "settings.budget_s differs" in res.stderr
    other = _split(doc, "hydra")
    other["data"]["val_digest"] = "0000"
    b.write_text(json.dumps(other))
    res = invoke(runner, ["race", "merge", a, b])
    assert res.exit_code == 1 and "data.val_digest differs" in res.stderr
    res = invoke(runner, ["race", "merge", a, a])
    assert res.exit_code == 1 and "configuration gpt is in both" in res.stderr
    (tmp_path / "bad.json").write_text("{}")
    res = invoke(runner, ["race", "merge", a, tmp_path / "bad.json"])
    assert res.exit_code == 1 and "not a race result" in res.stderr


def test_race_usage_errors(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    res = invoke(runner, ["race", "run", "--configs", "gpt,nope", "--quiet"])
    assert res.exit_code == 2 and "unknown configuration(s) ['nope']" in res.stderr
    res = invoke(runner, ["race", "run", "--set", "hydra=1", "--quiet"])
    assert res.exit_code == 2 and "CONFIG.FIELD=VALUE" in res.stderr
    res = invoke(runner, ["race", "run", "--corpus-root", tmp_path / "missing", "--quiet"])
    assert res.exit_code == 1 and "no such folder" in res.stderr
    help_text = invoke(runner, ["race", "--help"]).stdout
    assert "Fairness rules" in help_text and "hydra-diag race run" in help_text


def test_a_failing_entrant_does_not_lose_the_others(runner, tmp_path, monkeypatch):
    """One configuration raising mid-race (as an out-of-memory would) is recorded as failed, the
    others run and are reported, the JSON is written, and the command exits 1 naming it. Data: a
    shard folder (the non-pyenv path)."""
    import hydra_diag.race.runner as runner_mod
    from hydra_diag.synthetic import write_bigram_dataset

    _one_thread_reference_kernels()
    data = write_bigram_dataset(tmp_path / "bigram", 256, 20000, 3000)
    real = runner_mod.race_one

    def flaky(cfg, *args, **kw):
        if cfg.name == "hydra":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(cfg, *args, **kw)

    monkeypatch.setattr(runner_mod, "race_one", flaky)
    res = invoke(runner, tiny_race_args(data, tmp_path / "r.json"))
    assert res.exit_code == 1
    assert "hydra: RuntimeError: CUDA out of memory (simulated)" in res.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    gpt, hydra = doc["runs"]
    assert gpt["status"] == "ok" and gpt["steps"] > 0 and math.isfinite(gpt["final_val_loss"])
    assert hydra["status"] == "failed" and "out of memory" in hydra["error"] and hydra["evals"] == []
    assert doc["data"]["name"] == str(data) and doc["data"]["val_digest"]
    assert "failed" in res.stdout  # the status column appears when a run failed
