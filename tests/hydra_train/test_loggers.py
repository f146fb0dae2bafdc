"""A logger is a callback class plus its flag, registered in one place (hydra_train.loggers): the
flag becomes a configuration field and an option of `hydra-train run`, and the run builds it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from typer.main import get_command

from hydra_train import loggers
from hydra_train.callbacks import TrainerCallback
from hydra_train.cli import app
from hydra_train.config import TrainConfig
from hydra_train.config_options import RuntimeOptions


def test_each_registered_logger_is_a_runtime_field_and_a_run_option():
    assert list(loggers.LOGGERS) == ["tensorboard", "wandb"]
    fields = {f.name: f for f in dataclasses.fields(RuntimeOptions)}
    run = {p.name: p for p in get_command(app).commands["run"].params}
    for name, cls in loggers.LOGGERS.items():
        assert issubclass(cls, TrainerCallback) and fields[name].default is False
        assert run[name].help == cls.help and f"--{name}" in run[name].opts
        assert TrainConfig(**{name: True}).runtime.__getattribute__(name) is True


def test_build_loggers_builds_the_ones_switched_on(monkeypatch, tmp_path):
    built = []

    class Toy(TrainerCallback):
        name, help = "toy", "A logger for this test."

        def __init__(self, run_dir, run_id, config):
            built.append((run_dir, run_id, config))

        @classmethod
        def for_run(cls, run_dir, run_id, config):
            return cls(run_dir, run_id, config)

    monkeypatch.setattr(loggers, "LOGGERS", {})
    loggers.register_logger(Toy)
    cfg = SimpleNamespace(toy=True, to_dict=lambda: {"lr": 1.0})
    out = loggers.build_loggers(cfg, tmp_path, "run1")
    assert len(out) == 1 and isinstance(out[0], Toy) and built == [(tmp_path, "run1", {"lr": 1.0})]
    assert loggers.build_loggers(SimpleNamespace(toy=False, to_dict=dict), tmp_path, "run1") == []
