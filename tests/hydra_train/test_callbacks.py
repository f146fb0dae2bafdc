"""Callback plumbing: names, state round trip through checkpoints, StepMetrics floats, loggers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hydra_train.callbacks import CallbackList, StepMetrics, TensorBoardCallback, TrainerCallback
from hydra_train.errors import HydraTrainError


class Counter(TrainerCallback):
    def __init__(self, name):
        self.name = name
        self.n = 0

    def on_step_end(self, step, metrics):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_names_state_and_dispatch():
    a, b = Counter("a"), Counter("b")
    cbs = CallbackList([a, b])
    with pytest.raises(ValueError, match="already registered"):
        cbs.add(Counter("a"))
    cbs.call("on_step_end", 1, None)
    cbs.call("on_step_end", 2, None)
    state = cbs.state_dict()
    assert state == {"a": {"n": 2}, "b": {"n": 2}}
    fresh = CallbackList([Counter("a")])
    msgs = []
    fresh.load_state_dict({**state, "safe_optimizations": {"x": 1}}, log=msgs.append)
    assert fresh.callbacks[0].n == 2
    assert msgs and "b" in msgs[0] and "safe_optimizations" in msgs[0]


def test_step_metrics_as_floats():
    m = StepMetrics(
        3,
        torch.tensor(2.5),
        torch.tensor(2.25),
        {"z": torch.tensor(0.5), "a": torch.tensor(1.0)},
        torch.tensor(0.75),
        torch.tensor(False),
        lr=1e-3,
        tokens=64,
        tokens_per_s=10.0,
    )
    f = m.as_floats()
    assert f == {
        "loss": 2.5,
        "ce_loss": 2.25,
        "grad_norm": 0.75,
        "aux": {"a": 1.0, "z": 0.5},
        "finite": False,
        "step": 3,
        "lr": 1e-3,
        "tokens": 64,
        "tokens_per_s": 10.0,
    }


def test_tensorboard_flag(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(HydraTrainError, match=r"pip install 'hydra-train\[tensorboard\]'"):
            TensorBoardCallback(str(tmp_path))
    else:
        cb = TensorBoardCallback(str(tmp_path))
        cb.on_log(1, {"loss": 1.0, "aux": {"z": 0.1}})
        cb.on_train_end({})
        assert list(tmp_path.glob("events.out.tfevents*"))
