"""Loss-free MoE balancing on two gloo ranks follows the load of the whole global batch, as one
process on the combined batch does: each rank's biases moved by rank 0's load alone (DDP and
FSDP2 broadcast rank 0's buffers, ``pending_load`` with them), so the ranks routed by a bias one
process never had. The validation loss the ranks log is one process's on the same windows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hydra_train.run import run_training

from .conftest import tiny_config
from .test_ddp_runs import LOSS_FREE_MOE, _Record, _train

COMMON = dict(
    grad_accum=2, max_steps=3, log_every=1, save_every=0, eval_every=1, eval_batches=2,
    warmup_steps=1, model_overrides=LOSS_FREE_MOE,
)  # fmt: skip


@pytest.fixture(scope="module")
def one_process(bin_dataset, tmp_path_factory):
    """One process on the combined batch (batch 4 = two ranks of 2): its record and final state."""
    folder = tmp_path_factory.mktemp("one_process")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYDRA_CACHE_DIR", str(folder / "cache"))
    rec = _Record()
    try:
        run_training(tiny_config(bin_dataset, folder, batch_size=4, cpu_threads=1, **COMMON), callbacks=[rec])
    finally:
        mp.undo()
    state = torch.load(folder / "hydra_tiny_final.pt", weights_only=True)["model"]
    # as the ranks' records come back: through JSON (steps as strings)
    yield json.loads(json.dumps({"biases": rec.biases, "evals": rec.evals})), state
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param({}, id="ddp"),
        pytest.param({"fsdp": True}, id="fsdp"),
        # the hand-rolled averaging a CUDA-graphed DDP step runs, here eager
        pytest.param({"ddp_grad_sync": "allreduce"}, id="allreduce"),
    ],
)
def test_loss_free_biases_follow_the_global_batch(bin_dataset, tmp_path, one_process, mode):
    want, want_state = one_process
    records = _train(tmp_path, 2, data=bin_dataset, ckpt=tmp_path / "ck", batch_size=2, **mode, **COMMON)
    # the biases move at every training forward (each micro-batch), from the load before it
    assert any(v != 0 for step in want["biases"].values() for b in step.values() for v in b)
    for rank, rec in enumerate(records):
        assert sorted(rec["biases"]) == sorted(want["biases"])
        for step, biases in want["biases"].items():
            for name, b in biases.items():
                got = rec["biases"][step][name]
                assert got == pytest.approx(b, abs=1e-7), (rank, step, name)
        # evaluated on the same windows (each rank its share), the logged loss is one process's
        assert sorted(rec["evals"]) == sorted(want["evals"])
        for step, ev in want["evals"].items():
            assert rec["evals"][step]["val_loss"] == pytest.approx(ev["val_loss"], rel=1e-5), (rank, step)
    got_state = torch.load(tmp_path / "ck" / "hydra_tiny_final.pt", weights_only=True)["model"]
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        # pending_load included: a resume turns it into the next bias update
        torch.testing.assert_close(got_state[k], v, rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    shutil.rmtree(tmp_path, ignore_errors=True)
