"""``hydra-diag race`` at its edges: row-shard data whose rows fix the sequence length, Ctrl-C in
the middle of a race, the memory of a failed entrant, table overrides of ``max_seq_len``, and what
the tables and a merged document say."""

from __future__ import annotations

import gc
import inspect
import io
import json
import math
import weakref

import pytest
import torch

from hydra_diag.race.configs import resolve_configs
from hydra_diag.race.data import load_race_data
from tests.hydra_diag.conftest import invoke
from tests.hydra_diag.test_race import tiny_race_args


def _row_dataset(folder, row_len: int, seed: int = 0):
    """``folder/{train,val}/part0.pt``: 2-D row shards, every row ``row_len`` random ids < 256."""
    g = torch.Generator().manual_seed(seed)
    for split, rows in (("train", 96), ("val", 12)):
        (folder / split).mkdir(parents=True)
        torch.save(torch.randint(0, 256, (rows, row_len), generator=g), folder / split / "part0.pt")
    return folder


def test_row_shards_fix_the_sequence_length(tmp_path):
    """Rows of 33 tokens train on 32-token windows whatever --seq_len says (as hydra-train does):
    the race must count its tokens, FLOPs, epochs and max_seq_len at 32, not at the flag's 16."""
    messages: list[str] = []
    data = load_race_data(
        str(_row_dataset(tmp_path / "rows", 33)),
        seq_len=16,
        batch_size=4,
        seed=1,
        val_windows=4,
        vocab_size=256,
        progress=messages.append,
    )
    x, y = data.batch(0)
    assert x.shape == y.shape == (4, 32)
    assert data.seq_len == 32
    assert data.summary["train_tokens_windowed"] == 96 * 32
    assert all(vx.shape[1] == 32 for vx, _ in data.val_batches())
    assert any("32" in m for m in messages)  # the user is told the flag was overridden


def test_table_max_seq_len_does_not_cap_a_longer_race(tmp_path):
    """hydra-v1/v2/c3 carry their preset's max_seq_len=2048 in the configuration table: a race at
    --seq_len 4096 must raise it as it does for every other entrant, not crash those three."""
    from hydra_diag.race.loop import build_entrant

    shrink = {"dim": 64, "n_mor_blocks": 2, "n_heads": 2, "n_kv_heads": 1, "compression_factor": 2.0}
    (cfg,) = resolve_configs(["hydra-v2"], [("hydra-v2", shrink)], lr=1e-3, compile_default="none")
    assert cfg.overrides["max_seq_len"] == 2048  # from the table, not from the user
    model = build_entrant(cfg, "tiny", 256, 4096)
    assert model.config.max_seq_len >= 4096
    assert build_entrant(cfg, "tiny", 256, 128).config.max_seq_len == 2048  # long enough: left as is


def test_ctrl_c_keeps_the_entrants_that_finished(runner, tmp_path, monkeypatch):
    """Ctrl-C during the second entrant: the first one's measurements are written (JSON and table),
    the interrupted one is marked so, and the command exits 130 (as hydra-train run's Ctrl-C)."""
    import hydra_diag.race.runner as runner_mod
    from hydra_diag.synthetic import write_bigram_dataset

    data = write_bigram_dataset(tmp_path / "bigram", 256, 20000, 3000)
    real = runner_mod.race_one

    def interrupted(cfg, *args, **kw):
        if cfg.name == "hydra":
            raise KeyboardInterrupt
        return real(cfg, *args, **kw)

    monkeypatch.setattr(runner_mod, "race_one", interrupted)
    args = tiny_race_args(data, tmp_path / "r.json", budget=0.3)
    try:
        res = invoke(runner, args)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C lost the whole race: nothing was written")
    assert res.exit_code == 130
    doc = json.loads((tmp_path / "r.json").read_text())
    gpt, hydra = doc["runs"]
    assert gpt["status"] == "ok" and gpt["steps"] > 0 and math.isfinite(gpt["final_val_loss"])
    assert hydra["status"] == "interrupted"
    assert "hydra: interrupted" in res.stderr


def test_a_failed_entrants_model_is_gone_before_memory_is_released(monkeypatch):
    """An entrant that raised (an out-of-memory) must not keep its model alive through the
    exception's traceback while ``release`` frees memory for the next entrant."""
    import hydra_diag.race.runner as runner_mod
    from hydra_diag.race.loop import RaceSettings
    from hydra_diag.race.progress import RaceProgress

    refs: list[weakref.ref] = []
    alive_at_release: list[bool] = []

    def oom(cfg, *args, **kw):
        model = torch.nn.Linear(4, 4)  # stands for the entrant's model and optimizer state
        refs.append(weakref.ref(model))
        raise RuntimeError("CUDA out of memory (simulated)")

    def release(device):
        gc.collect()
        alive_at_release.append(refs[-1]() is not None)

    monkeypatch.setattr(runner_mod, "race_one", oom)
    monkeypatch.setattr(runner_mod, "release", release)
    monkeypatch.setattr(runner_mod, "check_buildable", lambda *a, **kw: None)
    data = type("D", (), {"vocab_size": 256, "seq_len": 16, "batch_size": 4, "summary": {}})()
    cfgs = resolve_configs(["gpt", "hydra"], [], lr=1e-3, compile_default="none")
    settings = RaceSettings(model_size="tiny", budget_s=1.0)
    with RaceProgress(["gpt", "hydra"], 1.0, enabled=False) as prog:
        doc = runner_mod.run_race(cfgs, data, settings, torch.device("cpu"), prog, {})
    assert [r["status"] for r in doc["runs"]] == ["failed", "failed"]
    assert alive_at_release == [False, False]


def _doc(runs: list[dict], **data) -> dict:
    settings = {"budget_s": 60.0, "evals": 2, "model_size": "tiny", "batch_size": 4, "seq_len": 16}
    settings |= {"val_windows": 64, "seed": 1}
    env = {"device_name": "cpu", "torch": "x", "triton": None, "date": "d", "command": "c"}
    return {"kind": "hydra-diag race", "settings": settings, "data": data, "environment": env, "runs": runs}


def _run(name: str, final: float) -> dict:
    evals = [{"val_loss": 5.0}, {"val_loss": final + 0.5}, {"val_loss": final}]
    return {"name": name, "status": "ok", "evals": evals, "final_val_loss": final}


def test_loss_table_marks_the_best_run_when_an_earlier_one_diverged():
    from hydra_diag.race.render import loss_table

    diverged = {**_run("gpt", math.nan), "status": "diverged"}
    table = loss_table(_doc([diverged, _run("hydra", 3.25)]))
    assert list(table.columns[-2].cells) == ["nan", "[bold]3.250[/]"]


def test_header_gives_the_validation_windows_actually_used():
    from hydra_diag.race.render import header_lines

    lines = header_lines(_doc([_run("gpt", 3.0)], val_windows_used=3, description="tiny"))
    assert "3 val windows" in lines[1] and "64 val windows" not in lines[1]


def test_merge_without_plots_does_not_list_the_first_runs_pngs(runner, tmp_path):
    """A merged document holds only the plots the merge itself drew: the first file's "plots"
    (PNGs of its own runs only) must not be carried over and printed as the merge's."""
    a, b = _doc([_run("gpt", 3.0)], val_digest="v"), _doc([_run("hydra", 2.9)], val_digest="v")
    a["plots"] = [str(tmp_path / "old" / "race_loss_vs_time.png")]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    res = invoke(runner, ["race", "merge", tmp_path / "a.json", tmp_path / "b.json", "--json", "-"])
    assert res.exit_code == 0, res.output
    merged = json.load(io.StringIO(res.stdout))
    assert [r["name"] for r in merged["runs"]] == ["gpt", "hydra"]
    assert "plots" not in merged
    res = invoke(runner, ["race", "merge", tmp_path / "a.json", tmp_path / "b.json"])
    assert res.exit_code == 0 and "plot:" not in res.stdout


def test_loss_table_columns_name_each_evaluation_time():
    """A 5 s budget in 10 evaluations is marked every 0.5 s: the columns must say so, not read
    0s 1s 2s 2s 2s 3s ... (whole seconds, rounded half to even)."""
    from hydra_diag.race.render import header_lines, loss_table

    doc = _doc([_run("gpt", 3.0)])
    doc["settings"] |= {"budget_s": 5.0, "evals": 10}
    heads = [c.header for c in loss_table(doc).columns[1:-1]]
    assert heads == [f"{t:g}s" for t in (0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5)]
    assert "5 s of training each" in header_lines(doc)[1]
    doc["settings"] |= {"budget_s": 120.0, "evals": 6}
    assert [c.header for c in loss_table(doc).columns[1:-1]] == ["20s", "40s", "60s", "80s", "100s", "120s"]


def test_each_finished_entrant_is_on_disk_before_the_next_starts(runner, tmp_path, monkeypatch):
    """A race killed during its second entrant (no Python handler runs) must keep the first: the
    JSON is written after each entrant, so when the second starts the file already holds the
    first's measurements."""
    import hydra_diag.race.runner as runner_mod
    from hydra_diag.synthetic import write_bigram_dataset

    data = write_bigram_dataset(tmp_path / "bigram", 256, 20000, 3000)
    real, seen = runner_mod.race_one, {}

    def second_reads_the_file(cfg, *args, **kw):
        if cfg.name == "hydra":
            seen["doc"] = json.loads((tmp_path / "r.json").read_text())
        return real(cfg, *args, **kw)

    monkeypatch.setattr(runner_mod, "race_one", second_reads_the_file)
    args = tiny_race_args(data, tmp_path / "r.json", budget=0.3)
    res = invoke(runner, args)
    assert res.exit_code == 0, res.stderr
    (first,) = seen["doc"]["runs"]
    assert first["name"] == "gpt" and first["status"] == "ok" and math.isfinite(first["final_val_loss"])
    final = json.loads((tmp_path / "r.json").read_text())
    assert [r["name"] for r in final["runs"]] == ["gpt", "hydra"]
    # no temporary file of the atomic write is left beside the JSON
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


def test_a_datasets_own_vocabulary_is_used_when_none_is_given(tmp_path):
    """Shards whose meta.json names a vocabulary larger than 32000 race at it when --vocab_size is
    not given (the CLI's old default, an explicit 32000, overrode it); an explicit value still
    wins, and where the dataset names none the default is 32000."""
    vocab = int(torch.randint(32001, 50000, ()).item())
    folder = _row_dataset(tmp_path / "rows", 33)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    common = dict(seq_len=32, batch_size=4, seed=1, val_windows=4)
    assert load_race_data(str(folder), vocab_size=None, **common).vocab_size == vocab
    assert load_race_data(str(folder), vocab_size=300, **common).vocab_size == 300
    plain = _row_dataset(tmp_path / "plain", 33)
    assert load_race_data(str(plain), vocab_size=None, **common).vocab_size == 32000
    from hydra_diag.commands.race import run_cmd

    assert inspect.signature(run_cmd).parameters["vocab_size"].default is None
