"""``trainer.request_stop`` on one rank under torchrun (gloo, CPU): every rank stops after the
same step and the final checkpoint is written. The asking rank alone used to stop, and its final
evaluation and save paired with the others' next step's collectives: gloo aborted the process
("collective mismatch") and the run ended without its final checkpoint (NCCL would hang)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training

from .conftest import tiny_config
from .test_ddp_runs import _free_port


class _StopOn(TrainerCallback):
    """Ask to stop on one rank only, after one step: a per-rank condition (a wall-clock budget)."""

    name = "stop_on_one_rank"

    def __init__(self, rank: int, asking: int, at_step: int) -> None:
        self.rank, self.asking, self.at_step = rank, asking, at_step

    def on_train_start(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, step: int, metrics) -> None:
        if self.rank == self.asking and step == self.at_step:
            self.trainer.request_stop(f"budget spent on rank {self.rank}")


def _rank(rank: int, world: int, port: int, out: str, asking: int, at_step: int, cfg_kw: dict) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )  # fmt: skip
    cfg_kw = dict(cfg_kw)
    cfg = tiny_config(Path(cfg_kw.pop("data")), Path(cfg_kw.pop("ckpt")), cpu_threads=1, **cfg_kw)
    summary = run_training(cfg, callbacks=[_StopOn(rank, asking, at_step)])
    keep = ("status", "steps", "stop_reason", "final_checkpoint")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({k: summary.get(k) for k in keep}))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_a_stop_asked_on_one_rank_stops_every_rank_after_the_same_step(bin_dataset, tmp_path, fsdp):
    world = 2
    asking = int(torch.randint(0, world, ()).item())
    log_every = 3
    at_step = int(torch.randint(1, log_every + 1, ()).item())
    out = tmp_path / "records"
    out.mkdir()
    ckpt = tmp_path / "ck"
    cfg_kw: dict[str, Any] = dict(
        data=str(bin_dataset), ckpt=str(ckpt), batch_size=2, max_steps=10, log_every=log_every,
        save_every=0, eval_every=100, eval_batches=1, warmup_steps=1, fsdp=fsdp,
    )  # fmt: skip
    args = (world, _free_port(), str(out), asking, at_step, cfg_kw)
    mp.spawn(_rank, args=args, nprocs=world, join=True)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    # every rank stops where the ranks sync anyway: the first log step from the request on
    want_step = -(-at_step // log_every) * log_every
    for rec in records:
        assert rec["status"] == "stopped", rec
        assert rec["steps"] == want_step, rec
        assert rec["stop_reason"] == f"budget spent on rank {asking}", rec
    final = torch.load(ckpt / "hydra_tiny_final.pt", weights_only=True)
    assert final["step"] == want_step
    assert records[0]["final_checkpoint"] == str(ckpt / "hydra_tiny_final.pt")
