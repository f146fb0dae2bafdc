"""A signal on one rank under torchrun (two gloo ranks on the CPU): every rank stops after the same
step, the checkpoint of that step is written (FSDP's save gathers from every rank) and every rank
ends as the signalled one would (exit 130 for SIGINT, 143 for SIGTERM, also on the rank that got
no signal). The ranks agree through a vote every step that is read one step later (trainer.py),
so they stop one step after the signal's step. Before, the signalled rank raised at once and the
other was left in the next collective (gloo: "Connection closed by peer"; NCCL hangs)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

from hydra_train.callbacks import TrainerCallback
from hydra_train.checkpoint import list_checkpoints, load_checkpoint

from .test_ddp_refusals import DEADLINE_S, _outcome
from .test_ddp_runs import _free_port
from .two_ranks import records_of_ranks


class _SignalOnRank(TrainerCallback):
    """``signum`` to this process when step ``at_step`` ends, on rank ``asking`` only."""

    name = "signal_on_rank"

    def __init__(self, rank: int, asking: int, at_step: int, signum: int) -> None:
        self.rank, self.asking, self.at_step, self.signum = rank, asking, at_step, signum
        self.steps: list[int] = []

    def on_step_end(self, step: int, metrics) -> None:
        self.steps.append(step)
        if self.rank == self.asking and step == self.at_step:
            os.kill(os.getpid(), self.signum)


def _rank(rank: int, world: int, port: int, out: str, cfg_kw: dict[str, Any], sig: list[int]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )  # fmt: skip
    cb = _SignalOnRank(rank, *sig)
    record = _outcome(cfg_kw, callbacks=[cb])
    record["last_step"] = cb.steps[-1] if cb.steps else None
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def _on_two_ranks(tmp: Path, cfg_kw: dict[str, Any], sig: list[int]) -> list[dict[str, Any]]:
    out = tmp / f"records_{_free_port()}"
    out.mkdir(parents=True)
    return records_of_ranks(_rank, (2, _free_port(), str(out), cfg_kw, sig), out, DEADLINE_S)


@pytest.mark.parametrize(
    ("fsdp", "signum", "code"),
    [(False, signal.SIGTERM, 143), (True, signal.SIGINT, 130)],
    ids=["ddp-sigterm", "fsdp-sigint"],
)
def test_a_signal_on_one_rank_saves_the_same_step_on_every_rank(bin_dataset, tmp_path, fsdp, signum, code):
    ckpt = tmp_path / "ck"
    cfg_kw: dict[str, Any] = dict(
        data=str(bin_dataset), ckpt=str(ckpt), batch_size=2, max_steps=12, log_every=5,
        save_every=4, eval_every=100, eval_batches=1, warmup_steps=1, fsdp=fsdp,
    )  # fmt: skip
    asking = 1  # not rank 0, the one that writes the file
    records = _on_two_ranks(tmp_path, cfg_kw, [asking, 5, int(signum)])
    for r, rec in enumerate(records):
        assert rec["escaped"] is None, rec["escaped"]
        assert rec["code"] == code, (r, rec["stderr"][-2000:])
        assert rec["last_step"] == 6, rec  # the vote of step 5 is read after step 6, on every rank
    assert sorted(p.name for p in list_checkpoints(ckpt)) == ["hydra_tiny_step4.pt", "hydra_tiny_step6.pt"]
    ck = load_checkpoint(ckpt / "hydra_tiny_step6.pt")
    assert ck["step"] == 6 and ck["data"]["world_size"] == 2
    with sqlite3.connect(ckpt / "training.db") as c:
        assert [r[0] for r in c.execute("SELECT status FROM runs")] == ["interrupted"]
    if not fsdp:
        return
    # the resume continues from step 6 on every rank, and ends as the uninterrupted run
    records = _on_two_ranks(tmp_path, {**cfg_kw, "resume": True}, [asking, -1, int(signum)])
    assert [rec["code"] for rec in records] == [0, 0], records[0]["stderr"][-2000:]
    full_kw = {**cfg_kw, "ckpt": str(tmp_path / "full")}
    records = _on_two_ranks(tmp_path, full_kw, [asking, -1, int(signum)])
    assert [rec["code"] for rec in records] == [0, 0], records[0]["stderr"][-2000:]
    a = torch.load(tmp_path / "full" / "hydra_tiny_final.pt", weights_only=True)["model"]
    b = torch.load(ckpt / "hydra_tiny_final.pt", weights_only=True)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
