"""MoE with loss-free balancing resumes bit for bit: the load the next training forward turns into
a bias update (``pending_load``) is in the checkpoint, and a checkpoint saved without it loads."""

from __future__ import annotations

import pytest
import torch

from hydra_model.moe import MoEFFN
from hydra_train.run import run_training

from .conftest import TINY_OVERRIDES, tiny_config
from .test_trainer import CrashAt, Recorder

LOSS_FREE = {
    **TINY_OVERRIDES,
    "moe_enabled": True,
    "moe_balancing": "loss_free",
    "moe_bias_update_rate": 0.05,
}


def test_loss_free_moe_resume_equals_uninterrupted(bin_dataset, tmp_path):
    def cfg(folder, **kw):
        return tiny_config(
            bin_dataset, tmp_path / folder, max_steps=8, save_every=4, model_overrides=LOSS_FREE, **kw
        )

    full, second = Recorder(), Recorder()
    run_training(cfg("a"), callbacks=[full])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg("b"), callbacks=[CrashAt(6)])
    run_training(cfg("b", resume=True), callbacks=[second])
    assert sorted(second.losses) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert second.losses[step] == full.losses[step], step  # bitwise
    a = torch.load(tmp_path / "a" / "hydra_tiny_final.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "hydra_tiny_final.pt", weights_only=True)["model"]
    assert any(k.endswith("balance_bias") and a[k].abs().sum() > 0 for k in a)  # the biases moved
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_state_dict_without_pending_load_loads_with_none_pending():
    moe = MoEFFN(8, 16, 4, balancing="loss_free")
    moe.train()
    moe(torch.randn(5, 8))
    assert moe.pending_load.sum() > 0
    state = moe.state_dict()
    assert "pending_load" in state
    fresh = MoEFFN(8, 16, 4, balancing="loss_free")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.pending_load, moe.pending_load)
    older = {k: v for k, v in state.items() if k != "pending_load"}  # saved before it was kept
    fresh.load_state_dict(older)  # strict
    assert torch.equal(fresh.pending_load, torch.zeros(4))
    assert torch.equal(fresh.balance_bias, moe.balance_bias)
