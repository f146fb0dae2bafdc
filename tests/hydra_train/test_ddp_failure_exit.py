"""A run that fails mid-training under torchrun (two gloo ranks on the CPU), after DDP or FSDP wrapped
the model: every rank exits promptly with the error line and exit status one process gives.

The exception's traceback kept the trainer and the wrapped model (with DDP's reducer and the
process group it holds) alive past ``shutdown_distributed``: freeing them after the group's end
hung the rank's exit or aborted it (SIGABRT), in some runs only (7 of 45 in 728ecc2). What decides
it is the order, checked on every run here: each rank records whether its wrapped model was still
alive when ``destroy_process_group`` was called (always, before the fix; a finished run's too,
kept by the trainer's reference cycle with its callbacks). Each rank runs what ``hydra-train run``
runs (run.py's ``run_training`` inside cli_errors.py's ``run_guarded``).

Measured on a 2-core CPU before the fix, a refusal shared by ``fail_together`` right after wrapping
(the case of 728ecc2) hung rank 0 in 9 and aborted a rank in 1 of 40 runs: the reducer held the
group's last reference, and its destructor joined gloo's worker threads holding the GIL while a
worker waited for the GIL to free the all-gather's tensors (gdb). A failure later in the loop ended
cleanly in those measurements (0 of 60: the tensors of its last collectives are the reducer's own),
yet it kept the model past the group's end all the same."""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hydra_train.callbacks import TrainerCallback
from hydra_train.distributed import fail_together
from hydra_train.errors import HydraCheckpointError, HydraDataError

from .test_ddp_refusals import _outcome
from .test_ddp_runs import _free_port
from .two_ranks import records_of_ranks

#: a case takes seconds; a rank hung at exit (or left in a collective) waits far longer
DEADLINE_S = 120
STEP_ERROR = "shard part1.bin went unreadable at step 2"
WRAP_ERROR = "refused on rank 0 after wrapping"


class _FailAt(TrainerCallback):
    """Raise, on the ranks named, after training step 2 (a data error found mid-run). Holds the
    wrapped model by a weak reference only: a strong one would keep it alive itself."""

    name = "fail_at"

    def __init__(self, rank: int, failing: tuple[int, ...]) -> None:
        self.rank, self.failing = rank, failing
        self.wrapped: weakref.ref | None = None

    def on_train_start(self, trainer) -> None:
        self.wrapped = weakref.ref(trainer.wrapped)

    def on_step_end(self, step: int, metrics) -> None:
        if step == 2 and self.rank in self.failing:
            raise HydraDataError(STEP_ERROR)


def _refuse_after_wrapping(fail: _FailAt) -> None:
    """run.py's ``wrap_model``, followed by a refusal of rank 0 that ``fail_together`` raises on
    every rank: the case 728ecc2 measured (run.py has none after wrapping since; this process's
    own copy of the module is patched)."""
    import hydra_train.run as run_module

    wrap = run_module.wrap_model

    def wrap_then_refuse(model, info, **kwargs):
        wrapped = wrap(model, info, **kwargs)
        fail.wrapped = weakref.ref(wrapped)
        with fail_together(info):
            if info.rank == 0:
                raise HydraCheckpointError(WRAP_ERROR)
        return wrapped

    run_module.wrap_model = wrap_then_refuse


def _rank(
    rank: int, port: int, out: str, failing: tuple[int, ...], where: str, cfg_kw: dict[str, Any]
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), HYDRA_CACHE_DIR=str(Path(out) / "cache"),
    )  # fmt: skip
    fail = _FailAt(rank, failing if where == "step" else ())
    if where == "wrap":
        _refuse_after_wrapping(fail)
    alive_at_destroy: list[bool] = []
    destroy = dist.destroy_process_group

    def probe(*args, **kwargs):  # this process's own torch: nothing outside it is patched
        alive_at_destroy.append(fail.wrapped is not None and fail.wrapped() is not None)
        return destroy(*args, **kwargs)

    dist.destroy_process_group = probe
    record = {**_outcome(cfg_kw, [fail]), "alive_at_destroy": alive_at_destroy, "ended": time.time()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def _on_two_ranks(
    tmp: Path, failing: tuple[int, ...], cfg_kw: dict[str, Any], where: str = "step"
) -> list[dict[str, Any]]:
    """Each rank's record; a rank that hangs (at exit or in a collective) or dies of a signal fails."""
    out = tmp / "records"
    out.mkdir()
    args = (_free_port(), str(out), failing, where, cfg_kw)
    return records_of_ranks(_rank, args, out, DEADLINE_S)


def _cfg(bin_dataset: Path, tmp_path: Path, fsdp: bool) -> dict[str, Any]:
    # log_every 3: no stop all-reduce at step 2 (trainer._stop_agreed), so a rank that did not fail
    # is in step 3's collectives when its peer leaves
    return dict(
        data=str(bin_dataset), ckpt=str(tmp_path / "ck"), batch_size=2, max_steps=6, log_every=3,
        save_every=0, eval_every=100, eval_batches=1, warmup_steps=1, fsdp=fsdp,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["step", "wrap"], ids=["mid_training", "after_wrapping"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_an_error_on_every_rank_after_wrapping_ends_each_with_its_line(bin_dataset, tmp_path, fsdp, where):
    ranks = _on_two_ranks(tmp_path, (0, 1), _cfg(bin_dataset, tmp_path, fsdp), where)
    line = "error: " + (STEP_ERROR if where == "step" else WRAP_ERROR)
    for rank, rec in enumerate(ranks):
        assert rec["escaped"] is None, (rank, rec["escaped"])
        assert rec["code"] == 1, (rank, rec)
        assert rec["stderr"].strip() == line, (rank, rec)
        # what decides a clean exit: the wrapped model freed before the group goes
        assert rec["alive_at_destroy"] == [False], (rank, rec)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_a_finished_run_frees_its_wrapped_model_before_the_group_goes(bin_dataset, tmp_path, fsdp):
    ranks = _on_two_ranks(tmp_path, (), _cfg(bin_dataset, tmp_path, fsdp))
    for rank, rec in enumerate(ranks):
        assert rec["escaped"] is None and rec["code"] == 0, (rank, rec)
        assert rec["alive_at_destroy"] == [False], (rank, rec)


def test_an_error_on_one_rank_ends_the_other_soon(bin_dataset, tmp_path):
    """Rank 1 fails alone; rank 0 goes on into the next step's collectives. It ends with gloo's
    "Connection closed by peer" (a traceback, not rank 1's line: a step does not share errors)
    within a second (0.2 s measured, before the fix too), not at gloo's 30-minute timeout."""
    ranks = _on_two_ranks(tmp_path, (1,), _cfg(bin_dataset, tmp_path, False))
    assert ranks[1]["escaped"] is None and ranks[1]["code"] == 1, ranks[1]
    assert ranks[1]["stderr"].strip() == "error: " + STEP_ERROR
    assert ranks[0]["escaped"] is not None or ranks[0]["code"] != 0, ranks[0]
    assert ranks[0]["ended"] - ranks[1]["ended"] < 30, ranks
    for rank, rec in enumerate(ranks):
        assert rec["alive_at_destroy"] == [False], (rank, rec)
