"""The start of a run under torchrun (two gloo ranks on the CPU) after the model is built: a failure
that one rank meets alone ends every rank with that rank's line and exit status.

Two steps of run.py came after the last shared check (distributed.fail_together): rank 0's first
writes to the metrics database (an SQLite error there, a full disk say, ended rank 0 while rank 1
went on into training and died in a collective), and the load of ``--resume``'s checkpoint on
every rank (rank 1 reads the file and compares its own data with the checkpoint's: a refusal
there ended rank 1 alone, and rank 0 died in the next collective, FSDP's loading among them).
Each rank runs what ``hydra-train run`` runs (test_ddp_refusals' ``_outcome``), with a fault put
into its own process."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from hydra_train.errors import HydraCheckpointError
from hydra_train.metrics_db import TrainingDB

from .test_ddp_refusals import _outcome
from .test_ddp_runs import _free_port
from .test_resume_data_change import _add_shard
from .two_ranks import records_of_ranks

#: a case takes seconds; a rank left in a collective (or hung at exit) waits far longer
DEADLINE_S = 120
DB_ERROR = "database or disk is full"
CALLBACK_ERROR = "a callback's saved state does not fit this run"


def _disk_full(*args, **kwargs):
    raise sqlite3.OperationalError(DB_ERROR)


def _inject(fault: str) -> None:
    """Put ``fault`` into this process's own copy of the code (nothing outside it is patched)."""
    if fault in ("upsert_model", "start_run"):  # a database write of rank 0 fails
        setattr(TrainingDB, fault, _disk_full)
    elif fault == "unreadable":  # the checkpoint cannot be read on this rank's node
        import torch

        load = torch.load

        def load_here(f, *args, **kwargs):
            if str(f).endswith(".pt"):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(f))
            return load(f, *args, **kwargs)

        torch.load = load_here
    elif fault == "callback_state":  # after FSDP's loading: a callback refuses its saved state
        from hydra_train.callbacks import CallbackList

        def refuse(self, state, log=print):
            raise HydraCheckpointError(CALLBACK_ERROR)

        CallbackList.load_state_dict = refuse
    else:
        raise ValueError(fault)


def _rank(rank: int, port: int, out: str, cfg_kw: list[dict[str, Any]], faults: dict[int, str]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )  # fmt: skip
    if rank in faults:
        _inject(faults[rank])
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(_outcome(cfg_kw[rank])))


def _on_two_ranks(tmp: Path, cfg_kw: list[dict[str, Any]], faults: dict[int, str]) -> list[dict[str, Any]]:
    """Each rank's outcome (``cfg_kw``: each rank's own); a rank still running at the deadline fails."""
    out = tmp / "records"
    out.mkdir()
    return records_of_ranks(_rank, (_free_port(), str(out), cfg_kw, faults), out, DEADLINE_S)


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


def _run_kw(data: Path, ckpt: Path, **kw: Any) -> dict[str, Any]:
    return {
        "data": str(data), "ckpt": str(ckpt), "batch_size": 2, "max_steps": 4, "log_every": 2,
        "save_every": 0, "eval_every": 100, "eval_batches": 1, **kw,
    }  # fmt: skip


@pytest.mark.parametrize("write", ["upsert_model", "start_run"])
def test_a_database_write_failing_on_rank_0_ends_every_rank_with_its_error(
    bin_dataset, tmp_path, monkeypatch, write
):
    """An SQLite error is one line and exit 1 in one process (cli_errors.run_guarded): every rank
    ends with that line (rank 1 died in gloo's "Connection closed by peer" from training's first
    collective)."""
    kw = _run_kw(bin_dataset, tmp_path / "ck")
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    with monkeypatch.context() as m:
        m.setattr(TrainingDB, write, _disk_full)
        one = _outcome({**kw, "ckpt": str(tmp_path / "one"), "batch_size": 4})
    want = _last_line(one["stderr"])
    assert one["code"] == 1 and one["escaped"] is None and DB_ERROR in want, one
    ranks = _on_two_ranks(tmp_path, [kw, kw], {0: write})
    for rank, rec in enumerate(ranks):
        assert rec["code"] == 1 and _last_line(rec["stderr"]) == want, (rank, rec)


@pytest.mark.parametrize(
    "case,fsdp",
    [
        ("data_on_rank_1", False),
        ("data_on_rank_1", True),
        ("unreadable_on_rank_1", False),
        ("callback_state", True),
    ],
    ids=["data_ddp", "data_fsdp", "unreadable_ddp", "callbacks_fsdp"],
)
def test_a_resume_failing_on_one_rank_ends_every_rank_with_its_line(
    checkpointed, tmp_path, monkeypatch, case, fsdp
):
    """Rank 1's own copy of the data differs from the checkpoint's (its node's, say), or rank 1
    cannot read the checkpoint rank 0 found, or (after FSDP loaded the weights) rank 0's callbacks
    refuse their saved state: every rank exits with that rank's line and status 1."""
    data, ckpt = checkpointed
    folder = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    kw = _run_kw(data, folder, resume=True, fsdp=fsdp, max_steps=6)
    cfg_kw, faults, want = [kw, kw], {}, None
    if case == "data_on_rank_1":
        changed = Path(shutil.copytree(data, tmp_path / "data"))
        _add_shard(changed)
        cfg_kw[1] = {**kw, "data": str(changed)}
        monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
        # one process on rank 1's data: its refusal (checkpoint.resume_data_position)
        one_kw = {**cfg_kw[1], "ckpt": str(shutil.copytree(ckpt, tmp_path / "one"))}
        one = _outcome({**one_kw, "batch_size": 4, "fsdp": False})
        assert one["code"] == 1 and "shards added: train/part2.bin" in one["stderr"], one
        want = one["stderr"].strip().replace(one_kw["ckpt"], str(folder))
    elif case == "unreadable_on_rank_1":
        faults, want = {1: "unreadable"}, "unreadable checkpoint (FileNotFoundError"
    else:
        faults, want = {0: "callback_state"}, f"error: {CALLBACK_ERROR}"
    ranks = _on_two_ranks(tmp_path, cfg_kw, faults)
    lines = [rec["stderr"].strip() for rec in ranks]
    for rank, (rec, line) in enumerate(zip(ranks, lines, strict=True)):
        # nothing past the guard (a gloo "Connection closed by peer" traceback before the fix)
        assert rec["escaped"] is None, (rank, rec["escaped"])
        assert rec["code"] == 1, (rank, rec)
        assert line.startswith("error: ") and want in line and "\n" not in line, (rank, rec)
    assert lines[0] == lines[1], lines
