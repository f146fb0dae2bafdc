"""What every rank does between building a run (run.py's ``_build``) and training it: the
``--resume`` checkpoint loaded, and the run recorded in the metrics database.

Under torchrun a step that one rank takes alone, or that can fail on one rank alone, is shared
(:func:`hydra_train.distributed.fail_together`): its failure ends every rank with the same line and
exit status, where it ended that rank alone and left the others to die in the next collective with
a gloo error (NCCL hangs). tests/hydra_train/test_ddp_shared_start.py checks each case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_train.checkpoint import ResumePoint, load_checkpoint
from hydra_train.distributed import broadcast_object, fail_together
from hydra_train.loggers import Logger
from hydra_train.run_guard import settle_dead_runs
from hydra_train.summary import describe_run, write_summary_json

if TYPE_CHECKING:
    from hydra_train.run import TrainingRun


def resume_run(run: TrainingRun, found: ResumePoint | None, log: Callable[[str], None]) -> None:
    """``--resume``: the checkpoint rank 0 found (there is one: see run.py's ``_build``), loaded on
    every rank."""
    if not run.cfg.runtime.resume:
        return
    path = broadcast_object(run.dist, str(found.path) if found else None)
    # the other ranks read the file rank 0 checked: one they cannot read (a node that does not see
    # rank 0's folder, a file changed since) ends every rank
    with fail_together(run.dist):
        if found is None:
            ck = load_checkpoint(path)
            found = ResumePoint(Path(path), int(ck["step"]), ck)
    run.trainer.resume_from(found)  # shares its own failures (trainer_state.py)
    run.resumed_from = found.checkpoint.get("run_id")
    # a new checkpoint: pretests rerun (resolved: the machine's records are shared by folders)
    run.safe.checkpoint = f"{Path(found.path).resolve()}@{found.step}"
    log(f"resuming from {found.path} (step {found.step}, run {run.resumed_from})")


def record_start(run: TrainingRun, log: Callable[[str], None]) -> None:
    """Rank 0 records the run in the metrics database: runs that died without a status marked
    killed, the model, the run's row. Shared: an SQLite error here (a full disk, a locked or
    read-only file) ended rank 0 while the others went on into training's first collective."""
    cfg = run.cfg
    with fail_together(run.dist):
        if run.dist.is_main:
            settle_dead_runs(run.db, log)
            model_cfg = run.model.config.to_dict()
            run.db.upsert_model(run.model_id, cfg.model.model_size, run.n_params, run.n_params_ne, model_cfg)
            run.db.start_run(
                run.trainer.run_id,
                run.model_id,
                run.trainer.step,
                cfg.to_dict(),
                resumed_from=run.resumed_from,
                device=str(run.device),
                world_size=run.dist.world_size,
            )


def nothing_to_train(run: TrainingRun, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The summary of a resume whose checkpoint already reached ``--max_steps``, else None. Such a
    run trains nothing, so it records nothing: no pretests, no run row in training.db (each call
    added an empty "finished" run) and no run folder left behind (the one ``_build`` made is
    removed while empty). Every rank holds the checkpoint's step, so under torchrun all return."""
    trainer, max_steps = run.trainer, run.cfg.runtime.max_steps
    if trainer.step < max_steps:
        return None
    log(
        f"the checkpoint is at step {trainer.step} >= --max_steps {max_steps}; nothing to train "
        "(pass a larger --max_steps to continue it)"
    )
    trainer.loader.close()
    trainer.status = "finished"
    summary = trainer.summary()
    describe_run(summary, run)
    try:  # the loggers _build opened (a W&B run, a TensorBoard writer) are closed; no run row
        for cb in trainer.callbacks:
            if isinstance(cb, Logger):
                cb.on_train_end(summary)
    finally:
        if run.db is not None:
            run.db.close()
        write_run_summary(run, summary)
        with contextlib.suppress(OSError):  # not empty (a logger wrote there): it stays
            run.artifacts.folder.rmdir()
    return summary


def write_run_summary(run: TrainingRun, summary: dict[str, Any]) -> None:
    """``--summary_dir``: the summary as JSON (rank 0), train_summary_<model>_<run>.json."""
    folder = run.cfg.runtime.summary_dir
    if run.dist.is_main and folder:
        name = f"train_summary_{run.model_id}_{run.trainer.run_id}.json"
        write_summary_json(summary, Path(folder) / name)
