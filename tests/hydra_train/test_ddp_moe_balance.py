"""Loss-free MoE balancing on two gloo ranks follows the load of the whole global batch, as one
process on the combined batch does: each rank's biases moved by rank 0's load alone (DDP and
FSDP2 broadcast rank 0's buffers, ``pending_load`` with them), so the ranks routed by a bias one
process never had. The validation loss the ranks log is one process's on the same windows.

The biases are compared exactly (abs 1e-7, far below one update of ``moe_bias_update_rate``): each
is a sum of +-rate steps, one per micro-batch, taken in the same order in both runs, so the float
rounding of the matmuls (half the rows per rank, gradients summed in another order, other CPU
kernels) cannot shift it by a little. It can only route a token to another expert, which moves a
bias by a whole step (as a load counted on one rank alone does) and no tolerance would tell apart;
that needs a token within that rounding of a tie between experts, which ``_Margins`` rules out for
the reference run (measured on a 2-core x86 CPU: scores of the same token differ by <= 4.8e-7
between the runs, the closest of the reference's 2304 routing decisions is 1.6e-5 from a tie)."""

from __future__ import annotations

import json
import math
import shutil
from functools import partial

import pytest
import torch

from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training

from .conftest import tiny_config
from .test_ddp_runs import LOSS_FREE_MOE, _Record, _train

COMMON = dict(
    grad_accum=2, max_steps=3, log_every=1, save_every=0, eval_every=1, eval_batches=2,
    warmup_steps=1, model_overrides=LOSS_FREE_MOE,
)  # fmt: skip


#: a routing decision closer than this to a tie may go either way between the runs (4x the rounding
#: measured, see the module docstring)
TIE_MARGIN = 2e-6


class _Margins(TrainerCallback):
    """The smallest gap, over every training forward, between a token's k-th and (k+1)-th routing
    score (probabilities plus balancing bias, as hydra_model/moe.py ranks them)."""

    name = "routing_margins"

    def __init__(self) -> None:
        self.smallest = math.inf

    def on_train_start(self, trainer) -> None:
        for moe in trainer.model.moe_layers():
            moe.router.register_forward_hook(partial(self._routed, moe))

    def _routed(self, moe, _router, _inputs, logits) -> None:
        if moe.training and torch.is_grad_enabled():
            scores = logits.detach().float().softmax(dim=-1) + moe.balance_bias
            top = scores.topk(moe.top_k + 1, dim=-1).values
            self.smallest = min(self.smallest, (top[:, -2] - top[:, -1]).min().item())


@pytest.fixture(scope="module")
def one_process(bin_dataset, tmp_path_factory):
    """One process on the combined batch (batch 4 = two ranks of 2): its record and final state."""
    folder = tmp_path_factory.mktemp("one_process")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYDRA_CACHE_DIR", str(folder / "cache"))
    rec, margins = _Record(), _Margins()
    try:
        cfg = tiny_config(bin_dataset, folder, batch_size=4, cpu_threads=1, **COMMON)
        run_training(cfg, callbacks=[rec, margins])
    finally:
        mp.undo()
    # else the comparison below could fail (or pass) by rounding alone: another --seed then
    assert margins.smallest >= TIE_MARGIN, f"a token routed {margins.smallest:.1e} from a tie"
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
