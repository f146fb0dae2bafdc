"""What a person reads from hydra-train: install hints verbatim (``[extra]`` is not rich markup),
configuration errors before any data is loaded, and the true --max_steps default in the help."""

from __future__ import annotations

import re
import sys

import pytest
from typer.testing import CliRunner

import hydra_train.build as build_mod
import hydra_train.run as run_mod
from hydra_train.cli import app
from hydra_train.config import DeviceInfo, TrainConfig, resolve_config
from hydra_train.errors import HydraTrainError
from tests.hydra_train.conftest import tiny_config

runner = CliRunner()


def test_tensorboard_install_hint_is_printed_verbatim(bin_dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were missing
    args = ["run", "--dataset", str(bin_dataset), "--model_size", "tiny", "--max_steps", "1", "--tensorboard"]
    args += ["--device", "cpu", "--checkpoint_dir", str(tmp_path), "--vocab_size", "320", "--seq_len", "16"]
    args += ["--model_override", "dim=64", "--model_override", "max_seq_len=64", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 1
    assert "pip install 'hydra-train[tensorboard]'" in res.output
    # said before anything is built: found when the loggers were built, it came after the data
    # loading and left a metrics database and an empty run folder behind
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_run_log_lines_keep_brackets(monkeypatch, tmp_path):
    """The dim log lines of a run print their text as is: a hint or a path with [x] survives."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=200)
    seen = {}

    def fake_load(cfg, log):
        log("pip install 'hydra-train[tensorboard]' and data[1]/x.bin")
        seen["loaded"] = True
        raise HydraTrainError("stop here")

    monkeypatch.setattr(run_mod, "load_run_data", fake_load)
    cfg = tiny_config(tmp_path, tmp_path / "ck")
    with pytest.raises(HydraTrainError, match="stop here"):
        run_mod.run_training(cfg, console=console)
    assert seen and "pip install 'hydra-train[tensorboard]' and data[1]/x.bin" in buf.getvalue()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model_size="huge"), "--model_size 'huge' is not a preset; choose from tiny, debug"),
        (dict(model_overrides={"no_such_field": 1}), "model config: "),
        (dict(arch="llama"), "--arch 'llama' is not one of"),
    ],
)
def test_configuration_errors_come_before_any_data_is_loaded(change, message, monkeypatch, tmp_path):
    def must_not_load(*a, **k):
        raise AssertionError("the data was loaded before the configuration was checked")

    monkeypatch.setattr(run_mod, "load_run_data", must_not_load)
    monkeypatch.setattr(build_mod, "load_data", must_not_load)
    cfg = tiny_config(tmp_path / "nowhere", tmp_path / "ck", **change)
    with pytest.raises(HydraTrainError, match=message):
        run_mod.run_training(cfg)


def test_cli_bad_model_size_is_one_line_without_touching_the_data(monkeypatch, tmp_path):
    monkeypatch.setattr(run_mod, "load_run_data", lambda *a, **k: pytest.fail("data loaded"))
    res = runner.invoke(
        app, ["run", "--model_size", "7B", "--device", "cpu", "--checkpoint_dir", str(tmp_path)]
    )
    assert res.exit_code == 2 and "--model_size '7B' is not a preset" in res.output


def test_max_steps_help_states_the_cpu_default():
    cpu = resolve_config(TrainConfig(), DeviceInfo("cpu"))
    gpu = resolve_config(TrainConfig(), DeviceInfo("cuda", 80.0, True))
    prod = resolve_config(TrainConfig(mode="production"), DeviceInfo("cpu"))
    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    flat = " ".join(res.output.replace("│", " ").split())
    want = f"testing mode {cpu.max_steps} on the CPU, {gpu.max_steps} on CUDA; production {prod.max_steps}"
    assert want in flat


def test_run_summary_at_80_columns_cuts_nothing(bin_dataset, tmp_path):
    import os
    import subprocess

    ckpt = tmp_path / "a_rather_long_folder_name_for_the_checkpoints_of_this_run" / "and_deeper"
    args = ["--dataset", str(bin_dataset), "--model_size", "tiny", "--max_steps", "2", "--device", "cpu"]
    args += ["--checkpoint_dir", str(ckpt), "--vocab_size", "320", "--seq_len", "16", "--batch_size", "2"]
    args += ["--model_override", "dim=64", "--model_override", "max_seq_len=64", "--eval_every", "2"]
    args += ["--experimental_prefetch_threads", "0"]
    res = subprocess.run(
        [sys.executable, "-m", "hydra_train", "run", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="80"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    table = [line for line in res.stdout.splitlines() if line[:1] in "┌│├└"]
    assert table and all(len(line) <= 80 for line in table)
    flat = "".join(line.strip(" │") for line in res.stdout.splitlines())
    assert str(ckpt / "hydra_tiny_final.pt") in flat.replace(" ", "")
    progress = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    # one line per log interval (a log file is read line by line), ending with elapsed time and ETA
    assert len(progress) == 3 and all(
        re.search(r"elapsed \d+:\d\d:\d\d  ETA (\d+:\d\d:\d\d|-)$", p) for p in progress
    )


def test_pretest_checks_the_model_before_the_data(monkeypatch, tmp_path):
    monkeypatch.setattr(run_mod, "load_run_data", lambda *a, **k: pytest.fail("data loaded"))
    args = ["pretest", "--model_size", "7B", "--dataset", str(tmp_path), "--device", "cpu"]
    res = runner.invoke(app, [*args, "--checkpoint_dir", str(tmp_path)])
    assert res.exit_code == 2 and "--model_size '7B' is not a preset" in res.output
