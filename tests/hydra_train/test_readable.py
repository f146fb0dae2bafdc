"""What a person reads from hydra-train: install hints verbatim (``[extra]`` is not rich markup),
configuration errors before any data is loaded, and the true --max_steps default in the help."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

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
    monkeypatch.setattr(run_mod, "load_data", must_not_load)
    cfg = tiny_config(tmp_path / "nowhere", tmp_path / "ck", **change)
    with pytest.raises(HydraTrainError, match=message):
        run_mod.run_training(cfg)


def test_cli_bad_model_size_is_one_line_without_touching_the_data(monkeypatch, tmp_path):
    monkeypatch.setattr(run_mod, "load_run_data", lambda *a, **k: pytest.fail("data loaded"))
    res = runner.invoke(
        app, ["run", "--model_size", "7B", "--device", "cpu", "--checkpoint_dir", str(tmp_path)]
    )
    assert res.exit_code == 1 and "--model_size '7B' is not a preset" in res.output


def test_max_steps_help_states_the_cpu_default():
    cpu = resolve_config(TrainConfig(), DeviceInfo("cpu"))
    gpu = resolve_config(TrainConfig(), DeviceInfo("cuda", 80.0, True))
    prod = resolve_config(TrainConfig(mode="production"), DeviceInfo("cpu"))
    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    flat = " ".join(res.output.replace("│", " ").split())
    want = f"testing mode {cpu.max_steps} on CPU, {gpu.max_steps} on a GPU; production {prod.max_steps}"
    assert want in flat
