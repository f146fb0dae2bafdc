"""Pretests leave no routing state behind: the step-0 probes' training-mode forwards add to the
causal thresholds' records and the MoE pending load, which must not reach an arm's (or
training's) first threshold commit or bias update."""

from __future__ import annotations

import pytest
import torch

from hydra_train.safe_opts.registry import Optimization, build_registry
from hydra_train.safe_opts.step0_probe import probe_against, reference_at

from .conftest import TINY_OVERRIDES
from .test_safe_opts_pretest import make_trainer, runner

LOSS_FREE = {**TINY_OVERRIDES, "moe_enabled": True, "moe_balancing": "loss_free"}


@pytest.fixture(autouse=True)
def _compile_fast(monkeypatch):
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "aot_eager")


def _buffers(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def test_the_step0_probes_leave_every_buffer_as_it_was(tmp_path):
    tr, batches = make_trainer(tmp_path, model_overrides=LOSS_FREE)
    tr.step_impl([tr.loader.next()])  # a step done: a pending load, thresholds committed once
    model = tr.model
    assert model.router_threshold_records() and model.moe_layers()
    before = _buffers(model)
    ref = reference_at(tr, batches(5), 2, tr.device)
    probe_against(tr, tr, batches(5), ref, tr.device)
    assert all(r.sum() == 0 for r in model.router_threshold_records())  # nothing recorded
    after = _buffers(model)
    for name, value in before.items():  # the pending load and statistics too
        assert torch.equal(after[name], value), name


class FailsBeforeCommit(Optimization):
    """An arm that fails after its step's forward recorded, before the thresholds' commit."""

    name = "compile"  # stands in for a registered name so the runner can look it up

    def requested(self):
        return True

    def activate(self, trainer):
        def fail(applied=None):
            raise RuntimeError("failed before the commit")

        trainer.model.commit_router_thresholds = fail
        self.active = True

    def deactivate(self, trainer):
        trainer.model.__dict__.pop("commit_router_thresholds", None)
        self.active = False


def test_an_arm_that_fails_mid_step_leaves_no_records_for_training(tmp_path):
    tr, batches = make_trainer(tmp_path, model_overrides=LOSS_FREE)
    before = _buffers(tr.model)
    reg = build_registry(tr.cfg)
    reg["compile"] = FailsBeforeCommit(tr.cfg)
    res = runner(tr, batches, reg).run(["compile"])["results"]["compile"]
    assert res["status"] == "FAIL" and "failed before the commit" in res["reason"]
    assert all(r.sum() == 0 for r in tr.model.router_threshold_records())
    after = _buffers(tr.model)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_prefetch_threads_passes_with_gradient_accumulation(tmp_path):
    # the reference probe's records reached the default arm's first commit and not the prefetch
    # arm's: a FAIL with a relative loss difference of 1e-4 where the two arms must agree exactly
    tr, batches = make_trainer(tmp_path, grad_accum=2, experimental_prefetch_threads=2)
    reg = build_registry(tr.cfg)
    res = runner(tr, batches, reg).run(["prefetch_threads"])["results"]["prefetch_threads"]
    assert res["status"] == "PASS", res.get("reason")
