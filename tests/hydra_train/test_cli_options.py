"""One configuration: every TrainConfig field with a flag is an option of `run` (and of `pretest`
where it says so), declared once; the command line parses into the same nested TrainConfig."""

from __future__ import annotations

import dataclasses
import json

from typer.main import get_command
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.config import TrainConfig
from hydra_train.config_options import PRETEST, RUN, SECTIONS

runner = CliRunner()


def _options(command: str) -> dict[str, tuple[str, ...]]:
    cmd = get_command(app).commands[command]
    return {p.name: tuple(sorted(p.opts + p.secondary_opts)) for p in cmd.params}


def _flagged() -> dict[str, tuple]:
    out = {}
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if "cli" in f.metadata:
                out[f.name] = f.metadata["cli"]
    return out


def test_every_flagged_field_is_an_option_of_the_commands_it_names():
    run, pretest = _options("run"), _options("pretest")
    for name, spec in _flagged().items():
        for command, opts in ((RUN, run), (PRETEST, pretest)):
            assert (name in opts) == (command in spec.commands), (command, name)
            if name in opts:  # both spellings of each flag
                for flag in spec.flags:
                    assert flag in opts[name] and flag.replace("_", "-") in opts[name]
    # the flags both commands take are the same flags
    for name in set(run) & set(pretest):
        assert run[name] == pretest[name], name


def test_sections_hold_the_fields_and_flat_names_reach_them():
    cfg = TrainConfig(batch_size=3, lr=2e-3, moe=True, checkpoint_dir="x", compile=True)
    assert (cfg.data.batch_size, cfg.optim.lr, cfg.model.moe) == (3, 2e-3, True)
    assert (cfg.runtime.checkpoint_dir, cfg.optimizations.compile) == ("x", True)
    copy = cfg.replace(batch_size=5)
    assert (cfg.batch_size, copy.batch_size) == (3, 5)  # the copy has its own sections
    flat = cfg.to_dict()
    assert set(flat) == set(TrainConfig.field_names()) and flat["batch_size"] == 3
    assert TrainConfig.from_dict({**flat, "from_a_newer_version": 1}) == cfg


def test_the_command_line_parses_into_one_config():
    res = runner.invoke(
        app,
        ["run", "--dry_run", "--json", "--device", "cpu", "--batch-size", "3", "--model_override", "dim=64",
         "--no-experimental_fa3", "--schedule", "wsd"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.stdout)["config"]
    assert (cfg["batch_size"], cfg["model_overrides"], cfg["experimental_fa3"], cfg["lr_schedule"]) == (
        3,
        {"dim": 64},
        False,
        "wsd",
    )
    assert cfg["progress"] is False  # --json: no progress bar


def test_the_summary_goes_where_summary_dir_says_not_to_the_machines_out(bin_dataset, tmp_path, monkeypatch):
    from hydra_train.run import run_training

    from .conftest import tiny_config

    elsewhere = tmp_path / "out"
    elsewhere.mkdir()
    monkeypatch.setenv("OUT", str(elsewhere))  # a variable of the measuring machine: not read
    summary = run_training(
        tiny_config(bin_dataset, tmp_path / "ck", max_steps=2, summary_dir=str(tmp_path / "s"))
    )
    written = list((tmp_path / "s").glob("train_summary_*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["run_id"] == summary["run_id"]
    assert list(elsewhere.iterdir()) == []
