"""``hydra-train run`` under torchrun on the CPU (gloo): every rank runs ``run_training`` in a
spawned process with the variables torchrun sets, and records what it logged and held. What the
ranks report, hold and resume is compared with each other and with one process on the combined
batch (test_distributed.py launches the real CLI; these are the quicker in-process runs)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hydra_train.callbacks import TrainerCallback
from hydra_train.run import run_training
from hydra_train.trainer_state import EMA_ALPHAS

from .conftest import TINY_OVERRIDES, tiny_config

LOSS_FREE_MOE = {
    **TINY_OVERRIDES,
    "moe_enabled": True,
    "moe_balancing": "loss_free",
    "moe_bias_update_rate": 0.05,  # large: a rank's own load moves its biases at once
}


class _Record(TrainerCallback):
    """Each log row's loss and EMAs, and the MoE balancing biases this rank holds after each step
    and at each evaluation."""

    name = "ddp_record"

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.biases: dict[int, dict[str, list[float]]] = {}
        self.evals: dict[int, dict[str, Any]] = {}

    def on_train_start(self, trainer) -> None:
        self.trainer = trainer

    def _biases(self) -> dict[str, list[float]]:
        named = self.trainer.model.named_buffers()
        return {n: b.tolist() for n, b in named if n.endswith("balance_bias")}

    def on_step_end(self, step: int, metrics) -> None:
        self.biases[step] = self._biases()

    def on_eval(self, step: int, val_loss: float) -> None:
        self.evals[step] = {"val_loss": val_loss, "biases": self._biases()}

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.rows.append({k: row[k] for k in ("step", "loss", "ema_short", "ema_medium")})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out: str, cfg_kw: dict[str, Any]) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # the pretest verdicts of the user's machine (~/.cache/hydra) are neither read nor written
        HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )
    cfg_kw = dict(cfg_kw)
    cfg = tiny_config(Path(cfg_kw.pop("data")), Path(cfg_kw.pop("ckpt")), cpu_threads=1, **cfg_kw)
    rec = _Record()
    run_training(cfg, callbacks=[rec])
    record = {"rows": rec.rows, "biases": rec.biases, "evals": rec.evals}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def _train(tmp: Path, world: int, **cfg_kw: Any) -> list[dict[str, Any]]:
    """``run_training`` on ``world`` ranks (DDP, or FSDP2 with ``fsdp=True``); each rank's record."""
    out = tmp / f"records_{_free_port()}"
    out.mkdir(parents=True)
    mp.spawn(_rank, args=(world, _free_port(), str(out), cfg_kw), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _ema(losses: list[float], alpha: float) -> float:
    """The bias-corrected EMA of ``losses`` (what the trainer logs as ema_*)."""
    ema = 0.0
    for x in losses:
        ema = alpha * ema + (1 - alpha) * x
    return ema / (1 - alpha ** len(losses))


def test_logged_loss_emas_are_those_of_the_rank_averaged_loss(bin_dataset, tmp_path):
    """The log row's loss is the mean over ranks; its EMAs were each rank's own loss's (the
    database got rank 0's, so ema_short after one step was not the loss logged beside it)."""
    records = _train(
        tmp_path, 2, data=bin_dataset, ckpt=tmp_path / "ck", batch_size=2, max_steps=3, log_every=1,
        save_every=2, eval_every=100, eval_batches=1, warmup_steps=1,
    )  # fmt: skip
    rows = records[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for rank, rec in enumerate(records):
        for i, row in enumerate(rec["rows"]):
            losses = [r["loss"] for r in rows[: i + 1]]
            assert row["loss"] == pytest.approx(losses[-1], rel=1e-6)  # the same mean on every rank
            for key, alpha in (("ema_short", EMA_ALPHAS[0]), ("ema_medium", EMA_ALPHAS[1])):
                want = _ema(losses, alpha)
                assert row[key] == pytest.approx(want, rel=1e-5), (rank, row["step"], key)
    # the checkpoint (saved at step 2, between log points of another interval too) holds that EMA
    saved = torch.load(tmp_path / "ck" / "hydra_tiny_step2.pt", weights_only=True)["trainer"]
    denom = 1 - torch.tensor(EMA_ALPHAS, dtype=torch.float64) ** 2
    got = (saved["ema"] / denom).tolist()
    assert got[0] == pytest.approx(rows[1]["ema_short"], rel=1e-9)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_fsdp_keeps_moe_balancing_biases_equal_on_every_rank(bin_dataset, tmp_path):
    """Loss-free MoE balancing moves a buffer from each forward's own routing. DDP broadcasts
    rank 0's buffers before a step; FSDP2 never syncs buffers, so each rank's biases followed its
    own data and the ranks routed the same tokens differently from step 2 on."""
    records = _train(
        tmp_path, 2, data=bin_dataset, ckpt=tmp_path / "ck", batch_size=2, max_steps=3, log_every=1,
        save_every=0, eval_every=100, eval_batches=1, warmup_steps=1, fsdp=True,
        model_overrides=LOSS_FREE_MOE,
    )  # fmt: skip
    first, second = (rec["biases"] for rec in records)
    assert sorted(first) == ["1", "2", "3"]
    # the biases moved (at the large rate they may swing back to zero at a step)
    assert any(v != 0 for step in first.values() for b in step.values() for v in b)
    for step in first:
        assert first[step] == second[step], step
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_fsdp_resumes_a_one_process_checkpoint_as_one_process_continues(bin_dataset, tmp_path, monkeypatch):
    """A checkpoint of one process (or DDP: both save ``optimizer.state_dict()``, parameters
    numbered) resumed with ``--fsdp`` on two ranks: it failed with ``KeyError: 'state.0.step'``
    (FSDP2 loads optimizer state by parameter name). It now continues as the one process did."""
    common = dict(
        max_steps=4, log_every=1, save_every=2, keep_checkpoints=0, eval_every=100, eval_batches=1,
        warmup_steps=1, cpu_threads=1,
    )  # fmt: skip
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    run_training(tiny_config(bin_dataset, tmp_path / "one", batch_size=4, **common))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy2(tmp_path / "one" / "hydra_tiny_step2.pt", resumed)
    common.pop("cpu_threads")
    _train(tmp_path, 2, data=bin_dataset, ckpt=resumed, batch_size=2, fsdp=True, resume=True, **common)
    want = torch.load(tmp_path / "one" / "hydra_tiny_final.pt", weights_only=True)
    got = torch.load(resumed / "hydra_tiny_final.pt", weights_only=True)
    assert got["step"] == 4 and got["data"]["world_size"] == 2
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_every_rank_evaluates_rank_0s_model(bin_dataset, tmp_path):
    """With several micro-batches a step, each rank moves its loss-free MoE biases from its own
    micro-batches after the step's one buffer sync (DDP's, before the first forward), so each rank
    evaluated its own variant of the model and the validation loss was of none of them (the
    checkpoint holds rank 0's)."""
    records = _train(
        tmp_path, 2, data=bin_dataset, ckpt=tmp_path / "ck", batch_size=2, grad_accum=2, max_steps=2,
        log_every=1, save_every=0, eval_every=1, eval_batches=1, warmup_steps=1,
        model_overrides=LOSS_FREE_MOE,
    )  # fmt: skip
    first, second = (rec["evals"] for rec in records)
    assert sorted(first) == ["0", "1", "2"]
    assert any(v != 0 for b in first["2"]["biases"].values() for v in b)  # the biases moved
    for step in first:
        assert first[step] == second[step], step
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("gpu", [0, 1, 3])
def test_a_single_gpu_named_under_torchrun_is_refused(gpu, tmp_path, monkeypatch):
    """``--device cuda:N`` under torchrun would put every rank on GPU N (NCCL then fails on a
    duplicate GPU, or the ranks contend for one card): refused before anything is built, naming
    the flag and what to pass instead, also on a machine without CUDA. One process may name it."""
    from hydra_train.device_setup import pick_device
    from hydra_train.errors import HydraTrainError
    from hydra_train.run import run_training
    from tests.hydra_train.conftest import tiny_config

    world = int(torch.randint(2, 9, ()).item())
    with pytest.raises(HydraTrainError, match=rf"--device cuda:{gpu}.*{world} processes.*--device cuda"):
        pick_device(f"cuda:{gpu}", 1, world)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world))):
        monkeypatch.setenv(name, value)
    cfg = tiny_config(tmp_path / "data", tmp_path / "ckpt", device=f"cuda:{gpu}")
    with pytest.raises(HydraTrainError, match=rf"--device cuda:{gpu}"):
        run_training(cfg)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    if not torch.cuda.is_available():  # one process: the usual "no CUDA" error, not this one
        with pytest.raises(HydraTrainError, match="no CUDA GPU"):
            pick_device(f"cuda:{gpu}", 0, 1)
