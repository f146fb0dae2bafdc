"""``hydra-train run``: build everything from a :class:`TrainConfig`, train, and summarise.

:func:`run_training` is the library entry point behind the CLI (tests and hydra-diag call it
too). In order: the process (:mod:`hydra_train.device_setup`), the automatic settings resolved for
the device, the checkpoint folder locked, the data, the model, optimizer and schedule
(:mod:`hydra_train.build`), the DDP/FSDP wrapper, the database, artifacts and callbacks, the
trainer, a resume when asked and the run's rows in the database (:mod:`hydra_train.run_start`);
then the optional optimizations are applied to the built run
(``SafeOptimizations.apply``: pretests, activation), the trainer trains, the final checkpoint is
written and the summary (:mod:`hydra_train.summary`) returned. A Ctrl-C or SIGTERM while the loop
runs saves the step it stops at first (:class:`hydra_train.run_guard.RunSignals`, trainer.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.text import Text

from hydra_train.artifacts import ArtifactsCallback, RunArtifacts
from hydra_train.atomic_files import atomic_write_bytes
from hydra_train.build import (
    build_model,
    build_optimizer_and_schedule,
    check_model_flags,
    load_run_data,
    param_counts,
    preset_vocab_size,
)
from hydra_train.callbacks import CallbackList, TrainerCallback
from hydra_train.checkpoint import (
    check_resume_dir,
    final_name,
    prune_checkpoints,
    resume_point,
    save_checkpoint,
    step_name,
)
from hydra_train.config import TrainConfig, compile_reason, model_id_for, resolve_config
from hydra_train.data_fingerprint import data_fingerprint
from hydra_train.data_parallel import capture_stream, graphed_ddp_possible
from hydra_train.dataset import BatchPlan, eval_batches
from hydra_train.device_setup import choose_cpu_threads, device_info, pick_device, seed_everything
from hydra_train.distributed import (
    DistInfo,
    broadcast_object,
    ending_together,
    fail_together,
    init_distributed,
    shutdown_distributed,
    wrap_model,
)
from hydra_train.errors import HydraTrainError
from hydra_train.loggers import build_loggers, check_logger_packages
from hydra_train.metrics_db import DB_NAME, TrainingDB
from hydra_train.optim import OptimizerChoice
from hydra_train.options import torchrun_launch, train_options
from hydra_train.prefetch import Prefetcher
from hydra_train.reporting import MetricsDBCallback, ProgressCallback
from hydra_train.run_guard import RunSignals, check_finite_weights, open_checkpoint_dir
from hydra_train.run_start import nothing_to_train, record_start, resume_run, write_run_summary
from hydra_train.safe_opts import pretest_log
from hydra_train.safe_opts.callback import SafeOptimizations
from hydra_train.summary import describe_run, summary_rows
from hydra_train.trainer import Trainer

# kept importable from here (hydra-diag and older scripts import them from hydra_train.run)
__all__ = [
    "build_model",
    "check_model_flags",
    "choose_cpu_threads",
    "device_info",
    "load_run_data",
    "pick_device",
    "preset_vocab_size",
    "run_training",
    "seed_everything",
    "summary_rows",
]


def _new_run_id(model_id: str) -> str:
    # the random part keeps two runs started in the same second (same process, too) apart
    return f"{model_id}_{time.strftime('%Y%m%d-%H%M%S')}_{uuid.uuid4().hex[:6]}"


def _keep_tokenizer_beside(tokenizer_path: Path | None, ckpt_dir: Path, log) -> None:
    """Copy the tokenizer the data was encoded with next to the checkpoints, so that
    ``hydra-model generate --checkpoint <dir>/hydra_<size>_final.pt`` finds it without a flag.
    A different tokenizer already there is replaced (the checkpoints written now need this one)."""
    if tokenizer_path is None:
        return
    target, tokenizer = ckpt_dir / "tokenizer.json", Path(tokenizer_path).read_bytes()
    if target.exists() and target.read_bytes() == tokenizer:
        return
    atomic_write_bytes(target, tokenizer)  # as every tokenizer is written (atomic_files.py)
    log(f"tokenizer copied to {target}")


def run_training(
    cfg: TrainConfig,
    *,
    callbacks: list[TrainerCallback] | None = None,
    console: Console | None = None,
    announce_commits: bool = False,
) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary (see :meth:`Trainer.summary` plus where things went)."""
    console = console or Console()
    train_options()  # a variable that cannot be used stops the run here, before anything is built
    check_logger_packages(cfg)  # so does --tensorboard / --wandb without its package
    launch = torchrun_launch()
    device = pick_device(cfg.runtime.device, launch.local_rank, launch.world_size)
    dist_info = init_distributed(device.type)
    # Ctrl-C and SIGTERM: at once until the trainer's loop runs, then a checkpoint first (run_guard)
    signals = RunSignals(announce=dist_info.is_main)
    restore_signals = signals.install()
    held: list = []  # the checkpoint folder's lock, once taken
    try:
        # the ranks end together, and a failure's traceback lets go of the wrapped model before the
        # process group goes (freed after it, it hung or aborted the rank): distributed.py says why
        with ending_together(dist_info):
            return _run(cfg, device, dist_info, callbacks or [], console, announce_commits, held, signals)
    finally:
        for lock in held:
            lock.release()
        restore_signals()
        shutdown_distributed(dist_info)


@dataclass
class TrainingRun:
    """A built run: what the summary describes and what the loop needs."""

    cfg: TrainConfig
    device: torch.device
    dist: DistInfo
    data: Any
    model: torch.nn.Module
    model_id: str
    n_params: int
    n_params_ne: int
    ckpt_dir: Path
    artifacts: RunArtifacts
    database: Path
    optimizer_choice: OptimizerChoice
    trainer: Trainer
    safe: SafeOptimizations
    db: TrainingDB | None
    resumed_from: str | None = None


def _run(
    cfg: TrainConfig,
    device: torch.device,
    dist_info: DistInfo,
    extra: list[TrainerCallback],
    console: Console,
    announce_commits: bool,
    held: list,
    signals: RunSignals,
) -> dict[str, Any]:
    main = dist_info.is_main

    def log(msg: str) -> None:
        if main:
            # a Text: paths with "[...]" or ":name:" and hints with "[extra]" print as they are
            console.print(Text(msg, style="dim"), highlight=False, soft_wrap=True)

    asked, cfg = cfg, resolve_config(cfg, device_info(device))
    # the one optimization whose default follows the run's length: say what it chose and why
    log(f"torch.compile: {compile_reason(asked, cfg, device.type)}")
    if device.type == "cpu":
        threads, why = choose_cpu_threads(cfg.runtime.cpu_threads)
        torch.set_num_threads(threads)
        log(f"CPU threads: {threads} ({why})")
    seed_everything(cfg.runtime.seed)
    import hydra_kernels

    hydra_kernels.set_use_triton_kernels(cfg.optimizations.triton_kernels)

    ckpt_dir = Path(cfg.runtime.checkpoint_dir)
    data = None  # rank 0 builds any cache first; the others then read it
    # a rank's refusal (rank 0 alone checks the folder) raised on every rank: fail_together says why
    with fail_together(dist_info):
        if main:  # before the data is read: a second run on this folder stops at once
            if cfg.runtime.resume:  # before the folder is made: a mistyped one is refused, not created
                check_resume_dir(ckpt_dir, model_id_for(cfg.model.model_size, cfg.model.arch))
            held.append(open_checkpoint_dir(ckpt_dir, log))
            data = load_run_data(cfg, log)
    with fail_together(dist_info):
        data = data if main else load_run_data(cfg, lambda m: None)
    cfg = cfg.replace(seq_len=data.seq_len, vocab_size=data.vocab_size)
    log(f"data: {data.description}")
    run, found = _build(cfg, data, device, dist_info, extra, console, announce_commits, log)
    # each rank's failure in these ends every rank (run_start.py)
    resume_run(run, found, log)
    if (done := nothing_to_train(run, log)) is not None:
        return done
    record_start(run, log)
    signals.stop = run.trainer.interrupt  # a signal in its loop: stop, save, then the interrupt
    try:
        return _train(run, log)
    finally:
        # the handler let go of the trainer: it held the wrapped model past the process group's
        # end (distributed.ending_together says why that must not be)
        signals.stop = None
        # a graphed step under DDP holds NCCL collectives: its graph goes before the process group
        # does (destroying the group first left both H100 ranks hanging at exit, 2026-11-25)
        if run.trainer.cuda_graphs is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the device done with the graph before it goes
        run.trainer.disable_cuda_graphs()


def _build(cfg, data, device, dist_info, extra, console, announce_commits, log):
    """Model, optimizer, loader, database, callbacks and trainer; a checkpoint to resume from is
    found and checked here, before anything in the folder changes (a refusal changes nothing)."""
    main = dist_info.is_main
    model = build_model(cfg, data.vocab_size, device)
    for ds in (data.train, data.val):  # ids past the model's embedding: refused on the host
        ds.check_max_seq_len(model.config.max_seq_len)
        ds.check_vocab_size(model.config.vocab_size)
    model_id = model_id_for(cfg.model.model_size, cfg.model.arch)
    n_params, n_params_ne = param_counts(model)
    log(
        f"model: {cfg.model.arch} {cfg.model.model_size} preset, {n_params / 1e6:.2f}M parameters, "
        f"vocab {model.config.vocab_size}, device {device}, {cfg.runtime.precision}, "
        f"world size {dist_info.world_size}"
    )
    if cfg.runtime.fsdp and not dist_info.enabled:
        raise HydraTrainError(
            "--fsdp shards across processes: launch with torchrun --nproc_per_node=N (N >= 2)"
        )
    ckpt_dir = Path(cfg.runtime.checkpoint_dir)
    run_id = broadcast_object(dist_info, _new_run_id(model_id))
    found, db, artifacts, loggers = None, None, None, []
    # a failure raised on every rank, before DDP/FSDP wraps the model: distributed.fail_together says why
    with fail_together(dist_info):
        # every rank's own data (each opens it): saved in each checkpoint, compared on --resume
        fingerprint = data_fingerprint(data.train, data.val)
        if main:  # in this order: a refusal changes nothing in the folder
            if cfg.runtime.resume:
                found = resume_point(
                    ckpt_dir, model_id, model.config, cfg, dist_info.world_size, log, fingerprint
                )
            _keep_tokenizer_beside(data.tokenizer_path, ckpt_dir, log)
            db, artifacts = TrainingDB(ckpt_dir / DB_NAME), RunArtifacts(ckpt_dir / "runs" / run_id)
            loggers = build_loggers(cfg, artifacts.folder, run_id)
    artifacts = artifacts or RunArtifacts(ckpt_dir / "runs" / run_id, rank=dist_info.rank)
    wrapped = wrap_model(
        model,
        dist_info,
        fsdp=cfg.runtime.fsdp,
        device=device,
        find_unused_parameters=cfg.runtime.ddp_find_unused_parameters,
        # on the capture stream when DDP steps may become CUDA graphs (data_parallel says why)
        init_stream=capture_stream(device)
        if graphed_ddp_possible(cfg, device, dist_info.world_size)
        else None,
    )
    choice, schedule = build_optimizer_and_schedule(
        model, cfg, log=lambda m: console.print(Text(m, style="yellow")) if main else None
    )
    plan = BatchPlan(
        data.train,
        cfg.data.batch_size,
        seed=cfg.runtime.seed,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
    )
    loader = Prefetcher(
        plan.batch,
        0,
        threads=cfg.optimizations.experimental_prefetch_threads,
        buffer_size=cfg.optimizations.prefetch_buffer_size,
        device=device,
    )
    val = eval_batches(
        data.val,
        cfg.data.batch_size,
        cfg.runtime.eval_batches,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
    )
    safe = next((cb for cb in extra if isinstance(cb, SafeOptimizations)), None)
    if safe is None:
        safe = SafeOptimizations(
            cfg,
            shared_dir=pretest_log.shared_pretest_dir(),
            log=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True) if main else None,
        )
    safe.configure(cfg)
    cbs = CallbackList([safe, *(cb for cb in extra if cb is not safe)])
    db_cb = None
    if main:
        db_cb = MetricsDBCallback(db, run_id, ckpt_dir, announce_commits=announce_commits)
        cbs.add(db_cb)
        if cfg.runtime.progress:
            cbs.add(ProgressCallback(console, cfg.runtime.max_steps))
        for logger in loggers:
            cbs.add(logger)
    cbs.add(ArtifactsCallback(artifacts))
    trainer = Trainer(
        model,
        cfg,
        optimizer=choice.optimizer,
        schedule=schedule,
        loader=loader,
        val_batches=val,
        device=device,
        dist_info=dist_info,
        wrapped=wrapped,
        callbacks=cbs,
        run_id=run_id,
        model_id=model_id,
        log=log,
    )

    def saver(tr: Trainer, final: bool) -> Path | None:
        payload = tr.checkpoint_payload(model.config.to_dict())  # every rank (FSDP gathers)
        path = ckpt_dir / (final_name(model_id) if final else step_name(model_id, tr.step))
        # rank 0 writes; every rank leaves when it is written, and its failure (a full disk, weights
        # not finite) is every rank's: the others went on into the next step's collectives, or,
        # after an interrupt's save, ended while rank 0 still wrote the file
        with fail_together(dist_info):
            if main:
                check_finite_weights(payload["model"], tr.step)
                save_checkpoint(payload, path)
                removed = prune_checkpoints(ckpt_dir, model_id, cfg.runtime.keep_checkpoints)
                db_cb.export()
                gone = f" (removed {', '.join(p.name for p in removed)})" if removed else ""
                log(f"saved {path}{gone}")
        return path if main else None

    trainer.saver = saver
    trainer.data_fingerprint = fingerprint
    run = TrainingRun(
        cfg, device, dist_info, data, model, model_id, n_params, n_params_ne, ckpt_dir, artifacts,
        ckpt_dir / DB_NAME, choice, trainer, safe, db,
    )  # fmt: skip
    return run, found


def _train(run: TrainingRun, log) -> dict[str, Any]:
    """Apply the optimizations, train, write the final checkpoint; the summary in every case."""
    trainer = run.trainer
    start_step = trainer.step
    summary: dict[str, Any] = {}
    try:
        # the pretests run in the status guard: a Ctrl-C or SIGTERM there ends the run
        # "interrupted" rather than leaving it "running"
        with trainer.recording_status():
            run.safe.apply(trainer)
        summary = trainer.train()
        if trainer.step > start_step:
            try:
                with trainer.recording_status():  # a Ctrl-C or SIGTERM here: "interrupted"
                    summary["final_checkpoint"] = str(trainer.save_checkpoint(final=True))
            except BaseException:
                summary["status"] = trainer.status
                raise
    finally:
        trainer.loader.close()
        if not summary:
            summary = trainer.summary()
        describe_run(summary, run)
        try:
            trainer.callbacks.call("on_train_end", summary)
        finally:  # a callback raising at the end: the database still closes, the summary still out
            if run.db is not None:
                run.db.close()
            write_run_summary(run, summary)
    return summary
