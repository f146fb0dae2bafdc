"""The loop on the real tiny preset: non-finite steps never applied, exact resume, accumulation,
and the swappable seams."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training
from hydra_train.trainer import Trainer

from .conftest import tiny_config


class Recorder(TrainerCallback):
    """Per-step float loss / finiteness, and (optionally) parameter snapshots."""

    name = "recorder"

    def __init__(self, snapshot_steps=()):
        self.losses: dict[int, float] = {}
        self.finite: dict[int, bool] = {}
        self.snapshot_steps = set(snapshot_steps)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.opt_snapshots: dict[int, list[torch.Tensor]] = {}

    def on_train_start(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, step, metrics):
        f = metrics.as_floats()
        self.losses[step] = f["loss"]
        self.finite[step] = f["finite"]
        if step in self.snapshot_steps:
            self.snapshots[step] = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
            self.opt_snapshots[step] = [
                v.clone()
                for s in self.trainer.optimizer.state.values()
                for v in s.values()
                if torch.is_tensor(v)
            ]


class NaNInjector(TrainerCallback):
    name = "nan_injector"

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_after_backward(self, step, model):
        if step == self.at_step:
            p = next(p for p in model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


def test_non_finite_step_is_never_applied(bin_dataset, tmp_path):
    rec = Recorder(snapshot_steps=(2, 3))
    s = run_training(
        tiny_config(bin_dataset, tmp_path / "ck", max_steps=5, log_every=1),
        callbacks=[NaNInjector(at_step=3), rec],
    )
    assert rec.finite == {1: True, 2: True, 3: False, 4: True, 5: True}
    for k, v in rec.snapshots[2].items():  # weights after the skipped step == weights before it
        assert torch.equal(v, rec.snapshots[3][k]), k
    for a, b in zip(rec.opt_snapshots[2], rec.opt_snapshots[3], strict=True):  # moments and step counts too
        assert torch.equal(a, b)
    assert s["skipped_steps"] == 1 and s["steps"] == 5 and s["status"] == "finished"
    assert all(math.isfinite(rec.losses[i]) for i in (4, 5))  # training went on, unharmed
    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(tmp_path / "ck" / "training.db") as db:
        rows = db.query("SELECT step, skipped_steps FROM steps ORDER BY step")
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]


class CrashAt(TrainerCallback):
    name = "crash"

    def __init__(self, step):
        self.step = step

    def on_step_end(self, step, metrics):
        if step == self.step:
            raise RuntimeError("simulated crash")


def test_resume_equals_uninterrupted(bin_dataset, tmp_path):
    full = Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "a", max_steps=8, save_every=4), callbacks=[full])
    first = Recorder()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(
            tiny_config(bin_dataset, tmp_path / "b", max_steps=8, save_every=4), callbacks=[first, CrashAt(6)]
        )
    assert sorted(p.name for p in (tmp_path / "b").glob("*.pt")) == ["hydra_tiny_step4.pt"]
    second = Recorder()
    s = run_training(
        tiny_config(
            bin_dataset,
            tmp_path / "b",
            max_steps=8,
            save_every=4,
            resume=True,
            experimental_prefetch_threads=2,
        ),
        callbacks=[second],
    )
    assert s["resumed_from"] is not None
    assert sorted(second.losses) == [5, 6, 7, 8]
    for step in range(1, 7):
        assert first.losses[step] == full.losses[step]
    for step in range(5, 9):
        assert second.losses[step] == full.losses[step], step  # bitwise, not approximately
    a = torch.load(tmp_path / "a" / "hydra_tiny_final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "hydra_tiny_final.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["data"]["position"] == b["data"]["position"] == 8
    assert [v for _, v in a["trainer"]["val_history"]] == [v for _, v in b["trainer"]["val_history"]]


def test_grad_accumulation_matches_the_larger_batch(bin_dataset, tmp_path):
    big, acc = Recorder(), Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "a", max_steps=3, batch_size=8), callbacks=[big])
    run_training(
        tiny_config(bin_dataset, tmp_path / "b", max_steps=3, batch_size=4, grad_accum=2), callbacks=[acc]
    )
    for step in (1, 2, 3):
        assert acc.losses[step] == pytest.approx(big.losses[step], rel=1e-5, abs=1e-5)


class SwapToEagerCopy(TrainerCallback):
    """Exercises the seams: a different forward module and step implementation mid-run."""

    name = "swapper"

    def on_train_start(self, trainer):
        self.trainer = trainer
        self.calls = 0

    def on_step_end(self, step, metrics):
        if step == 2:
            tr = self.trainer
            eager = tr.eager_step

            def counting_step(batches):
                self.calls += 1
                return eager(batches)

            tr.step_impl = counting_step
            tr.forward_model = tr.model
            new_opt = torch.optim.AdamW(tr.model.parameters(), lr=tr.cfg.lr, foreach=True)
            tr.set_optimizer(new_opt)


def test_seams_can_be_swapped_mid_run(bin_dataset, tmp_path):
    sw = SwapToEagerCopy()
    rec = Recorder()
    s = run_training(tiny_config(bin_dataset, tmp_path / "ck", max_steps=5), callbacks=[sw, rec])
    assert sw.calls == 3 and s["steps"] == 5
    assert all(math.isfinite(v) for v in rec.losses.values())


def test_model_flags_reach_the_model(bin_dataset, tmp_path):
    """Activation checkpointing and chunked CE change how, not what: same losses. MoE and static routing
    change the model: they train and say so in the saved config."""
    base = Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "base", max_steps=3), callbacks=[base])
    ckpt, chunked = Recorder(), Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "ck", max_steps=3, checkpoint_every=1), callbacks=[ckpt])
    run_training(tiny_config(bin_dataset, tmp_path / "ce", max_steps=3, chunked_ce=True), callbacks=[chunked])
    for step in (1, 2, 3):
        assert ckpt.losses[step] == pytest.approx(base.losses[step], rel=1e-6)
        assert chunked.losses[step] == pytest.approx(base.losses[step], rel=1e-4)
    moe = Recorder()
    run_training(
        tiny_config(
            bin_dataset, tmp_path / "moe", max_steps=2, moe=True, moe_num_experts=3, static_routing_mode=True
        ),
        callbacks=[moe],
    )
    assert all(math.isfinite(v) for v in moe.losses.values())
    saved = torch.load(tmp_path / "moe" / "hydra_tiny_final.pt", weights_only=True)["config"]["model"]
    assert (saved["moe_enabled"], saved["moe_num_experts"], saved["static_routing_mode"]) == (True, 3, True)
    from hydra_train.metrics_db import TrainingDB

    with TrainingDB(tmp_path / "moe" / "training.db") as db:
        assert db.query("SELECT count(*) AS n FROM routing_moe")[0]["n"] > 0
