"""A run refused before training, under torchrun (two gloo ranks on the CPU): every rank ends with
the refusal one process prints, and its exit status. Rank 0 alone checks ``--resume``'s folder and
checkpoint and opens the metrics database; a refusal there ended rank 0 with its clear line while
the other rank, already in the next collective, died with a gloo error that buried the reason
(NCCL would hang). Each rank runs what ``hydra-train run`` runs (run.py's ``run_training`` inside
cli_errors.py's ``run_guarded``) and records its exit status and stderr."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
import typer
from rich.console import Console

from hydra_train.cli_errors import run_guarded
from hydra_train.errors import HydraCheckpointError, HydraDataError
from hydra_train.run import run_training

from .conftest import TINY_OVERRIDES, tiny_config
from .test_ddp_runs import _free_port
from .test_resume_data_change import _add_shard
from .two_ranks import records_of_ranks

#: a case takes seconds; a rank left in a collective (or hung at exit) waits for far longer
DEADLINE_S = 180


def _outcome(cfg_kw: dict[str, Any], callbacks: list | None = None) -> dict[str, Any]:
    """Exit status and stderr of ``hydra-train run`` with ``cfg_kw`` (and ``callbacks``), or the
    exception that got past its guard (a traceback, as the CLI would print it)."""
    cfg_kw = dict(cfg_kw)
    cfg = tiny_config(Path(cfg_kw.pop("data")), Path(cfg_kw.pop("ckpt")), cpu_threads=1, **cfg_kw)
    err = io.StringIO()
    record: dict[str, Any] = {"code": None, "escaped": None}
    with contextlib.redirect_stderr(err):
        try:
            run = lambda: run_training(cfg, callbacks=callbacks, console=Console(file=io.StringIO()))
            run_guarded(run, debug=False, resume_hint="")
            record["code"] = 0
        except typer.Exit as exc:
            record["code"] = exc.exit_code
        except BaseException:
            record["escaped"] = traceback.format_exc()
    record["stderr"] = err.getvalue()
    return record


def _rank(rank: int, world: int, port: int, out: str, cfg_kw: dict[str, Any]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )  # fmt: skip
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(_outcome(cfg_kw)))


def _on_two_ranks(tmp: Path, cfg_kw: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's outcome; a rank still running at the deadline (left in a collective) fails."""
    out = tmp / f"records_{_free_port()}"
    out.mkdir(parents=True)
    return records_of_ranks(_rank, (2, _free_port(), str(out), cfg_kw), out, DEADLINE_S)


@pytest.mark.parametrize("case", ["changed_data", "other_config", "no_checkpoint", "bad_database"])
def test_a_refusal_on_rank_0_ends_every_rank_with_its_message(checkpointed, tmp_path, monkeypatch, case):
    data, ckpt = checkpointed
    folder = tmp_path / "ck"
    shutil.copytree(ckpt, folder)  # each case its own folder: a refusal must change nothing in it
    kw: dict[str, Any] = dict(data=str(data), ckpt=str(folder), batch_size=2, max_steps=4, resume=True)
    want = None
    if case == "changed_data":  # refused by checkpoint.resume_point (in run._build)
        data = Path(shutil.copytree(data, tmp_path / "data"))
        _add_shard(data)
        kw["data"], want = str(data), "shards added: train/part2.bin"
    elif case == "other_config":  # refused by checkpoint.check_model_config (in resume_point)
        kw["model_overrides"], want = {**TINY_OVERRIDES, "mlp_ratio": 2.0}, "different model config"
    elif case == "no_checkpoint":  # refused by checkpoint.check_resume_dir (in run._run)
        kw["ckpt"], want = str(tmp_path / "mistyped"), "does not exist"
    else:  # not an SQLite file: refused when rank 0 opens it (metrics_schema.check_sqlite_file)
        (folder / "training.db").write_text("someone else's notes\n")
        kw["resume"], want = False, "is not an SQLite database"
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    one = _outcome({**kw, "batch_size": 4})  # one process on the same global batch
    assert one["escaped"] is None and one["code"] == 1, one
    line = one["stderr"].strip()
    assert line.startswith("error: ") and want in line and "\n" not in line, line
    ranks = _on_two_ranks(tmp_path, kw)
    for rank, rec in enumerate(ranks):
        # nothing past the guard (a gloo "Connection closed by peer" traceback before the fix)
        assert rec["escaped"] is None, (rank, rec["escaped"])
        assert rec["code"] == one["code"], (rank, rec)
        assert rec["stderr"].strip() == line, (rank, rec["stderr"])
    assert sorted(p.name for p in folder.iterdir()) == before


class _TwoArgs(Exception):
    """An exception pickle cannot rebuild (its constructor takes two arguments, ``args`` holds one)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} and {b}")


#: scenario -> what each rank's block raises (None: nothing)
SCENARIOS: dict[str, tuple[Exception | None, Exception | None]] = {
    "none": (None, None),
    "rank1_only": (None, HydraDataError("shard part7.bin is unreadable on this node")),
    "both": (HydraCheckpointError("refused on rank 0"), HydraDataError("rank 1's own")),
    "not_portable": (_TwoArgs("x", "y"), None),
}


def _block_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hydra_train.distributed import DistInfo, fail_together

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    info, got = DistInfo(rank, world, rank, "gloo"), {}
    for name, raised in SCENARIOS.items():
        try:
            with fail_together(info):
                if raised[rank] is not None:
                    raise raised[rank]
            got[name] = None
        except Exception as exc:
            got[name] = [type(exc).__name__, str(exc)]
    dist.barrier()  # every rank still in step after every scenario
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(got))


def test_fail_together_raises_the_lowest_failing_ranks_error_on_every_rank(tmp_path):
    """The block of any rank, not rank 0's alone: a rank that fails by itself (its own copy of
    the data) stops the others too, the lowest failing rank's error wins, and an error that
    cannot cross processes arrives as a RuntimeError naming it."""
    mp.start_processes(_block_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(ranks):
        assert got["none"] is None
        assert got["rank1_only"] == ["HydraDataError", "shard part7.bin is unreadable on this node"]
        assert got["both"] == ["HydraCheckpointError", "refused on rank 0"]
        want = ["_TwoArgs", "x and y"] if rank == 0 else ["RuntimeError", "rank 0 failed: _TwoArgs: x and y"]
        assert got["not_portable"] == want, rank
