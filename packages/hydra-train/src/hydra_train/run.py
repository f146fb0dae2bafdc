"""``hydra-train run``: build everything from a :class:`TrainConfig`, train, and summarise.

:func:`run_training` is the library entry point behind the CLI (tests and SafeOptimizations call it
too): it resolves the automatic settings for the device, opens the data, builds the model, wraps it
for DDP/FSDP, builds the optimizer, schedule, database, artifacts and callbacks, resumes when asked,
trains, writes the final checkpoint and returns the summary dict that the CLI prints.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.text import Text

from hydra_train.artifacts import ArtifactsCallback, RunArtifacts
from hydra_train.callbacks import CallbackList, TensorBoardCallback, TrainerCallback, WandbCallback
from hydra_train.checkpoint import (
    check_model_config,
    final_name,
    find_resume_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_name,
)
from hydra_train.config import DeviceInfo, TrainConfig, model_id_for, resolve_config
from hydra_train.data_sources import load_data
from hydra_train.dataset import BatchPlan, eval_batches
from hydra_train.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown_distributed,
    wrap_model,
)
from hydra_train.errors import HydraTrainError
from hydra_train.metrics_db import DB_NAME, TrainingDB
from hydra_train.optim import LRSchedule, build_optimizer
from hydra_train.prefetch import Prefetcher
from hydra_train.reporting import MetricsDBCallback, ProgressCallback
from hydra_train.run_guard import (
    check_finite_weights,
    install_sigterm,
    open_checkpoint_dir,
    settle_dead_runs,
)
from hydra_train.trainer import Trainer


def pick_device(pref: str, local_rank: int = 0) -> torch.device:
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HydraTrainError("--device cuda was asked for but no CUDA GPU is visible here")
        return torch.device("cuda", local_rank) if pref == "cuda" else torch.device(pref)
    if pref != "cpu":
        raise HydraTrainError(f"--device {pref!r}: use auto, cpu, cuda or cuda:N")
    return torch.device("cpu")


def device_info(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo("cpu")
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo("cuda", props.total_memory / 2**30, torch.cuda.is_bf16_supported())


def choose_cpu_threads(requested: int | None) -> tuple[int, str]:
    """Intra-op threads for CPU training: ``requested``, or the cores nobody else is using.

    On a shared machine two OpenMP threads that keep getting descheduled wait on each other at every
    op; one thread is then several times faster than two, so "auto" counts busy cores by the load
    average."""
    if requested:
        return requested, "--cpu_threads"
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = max(1, min(cores, cores - round(load)))
    return n, f"auto: load average {load:.1f} on {cores} cores"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def preset_vocab_size(model_size: str) -> int:
    """The vocabulary the preset defines (HydraConfig's default when it names none): what the data
    is tokenized to when --vocab_size is not given."""
    from hydra_model import MODEL_PRESETS, HydraConfig

    return MODEL_PRESETS.get(model_size, {}).get("vocab_size", HydraConfig.vocab_size)


def load_run_data(cfg: TrainConfig, log: Callable[[str], None]) -> Any:
    """The data ``cfg`` names (--dataset, --seq_len, --tokenizer), tokenized to --vocab_size or,
    without one, to the preset's vocabulary."""
    return load_data(
        cfg.dataset,
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        default_vocab=preset_vocab_size(cfg.model_size),
        tokenizer=cfg.tokenizer,
        text_column=cfg.text_column,
        log=log,
    )


def _model_overrides(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    overrides: dict[str, Any] = {"vocab_size": vocab_size}
    if cfg.chunked_ce:
        overrides["use_chunked_ce"] = True
    if cfg.static_routing_mode:
        overrides["static_routing_mode"] = True
    if cfg.moe:
        overrides.update(moe_enabled=True, moe_num_experts=cfg.moe_num_experts)
    overrides.update(cfg.model_overrides)
    return overrides


def check_model_flags(cfg: TrainConfig) -> None:
    """The model flags (--model_size, --model_override, ...) checked before any data is read, so that
    a typo is reported at once instead of after the corpus is tokenized."""
    import hydra_model

    sizes = hydra_model.MODEL_PRESETS  # both architectures have these preset names
    if cfg.model_size not in sizes:
        raise HydraTrainError(
            f"--model_size {cfg.model_size!r} is not a preset; choose from {', '.join(sizes)}"
        )
    vocab = cfg.vocab_size or preset_vocab_size(cfg.model_size)  # the data may change it later
    try:
        hydra_model.build_config(cfg.arch, cfg.model_size, **_model_overrides(cfg, vocab))
    except (ValueError, TypeError) as exc:
        raise HydraTrainError(f"model config: {exc}") from None


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    """The ``--arch`` model for ``cfg`` (preset + flags + ``model_overrides``) on ``device``."""
    import hydra_model

    check_model_flags(cfg)
    try:
        model = hydra_model.build_model(cfg.arch, cfg.model_size, **_model_overrides(cfg, vocab_size))
    except ValueError as exc:
        raise HydraTrainError(f"model config: {exc}") from None
    if cfg.checkpoint_every:
        model.enable_gradient_checkpointing(every=cfg.checkpoint_every)
    return model.to(device)


def _param_counts(model) -> tuple[int, int]:
    if hasattr(model, "num_parameters"):
        return model.num_parameters(), model.num_parameters(exclude_embeddings=True)
    n = sum(p.numel() for p in model.parameters())
    return n, n


def _new_run_id(model_id: str) -> str:
    # the random part keeps two runs started in the same second (same process, too) apart
    return f"{model_id}_{time.strftime('%Y%m%d-%H%M%S')}_{uuid.uuid4().hex[:6]}"


def _keep_tokenizer_beside(tokenizer_path: Path | None, ckpt_dir: Path, log) -> None:
    """Copy the tokenizer the data was encoded with next to the checkpoints, so that
    ``hydra-model generate --checkpoint <dir>/hydra_<size>_final.pt`` finds it without a flag.
    A different tokenizer already there is replaced (the checkpoints written now need this one)."""
    if tokenizer_path is None:
        return
    target = ckpt_dir / "tokenizer.json"
    src = Path(tokenizer_path)
    if target.exists() and target.read_bytes() == src.read_bytes():
        return
    tmp = target.with_suffix(".json.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, target)
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
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.device, local_rank)
    dist_info = init_distributed(device.type)
    restore_sigterm = install_sigterm()
    held: list = []  # the checkpoint folder's lock, once taken
    try:
        summary = _run(cfg, device, dist_info, callbacks or [], console, announce_commits, held)
        # every rank done with its collectives before the group is destroyed: a rank tearing gloo
        # down while another still talks to it aborted the process ("terminate called without an
        # active exception", seen once in the 2-process FSDP test under load)
        barrier(dist_info)
        return summary
    finally:
        for lock in held:
            lock.release()
        restore_sigterm()
        shutdown_distributed(dist_info)


def _run(
    cfg: TrainConfig,
    device: torch.device,
    dist_info: DistInfo,
    extra: list[TrainerCallback],
    console: Console,
    announce_commits: bool,
    held: list,
) -> dict[str, Any]:
    main = dist_info.is_main

    def log(msg: str) -> None:
        if main:
            # a Text: paths with "[...]" or ":name:" and hints with "[extra]" print as they are
            console.print(Text(msg, style="dim"), highlight=False, soft_wrap=True)

    cfg = resolve_config(cfg, device_info(device))
    if device.type == "cpu":
        threads, why = choose_cpu_threads(cfg.cpu_threads)
        torch.set_num_threads(threads)
        log(f"CPU threads: {threads} ({why})")
    seed_everything(cfg.seed)
    import hydra_kernels

    hydra_kernels.set_use_triton_kernels(cfg.triton_kernels)

    check_model_flags(cfg)  # before the data: a bad --model_size must not wait for tokenization
    ckpt_dir = Path(cfg.checkpoint_dir)
    if main:  # before the data is read: a second run on this folder stops at once
        held.append(open_checkpoint_dir(ckpt_dir, log))

    # rank 0 builds any cache first; the others then read it
    data = load_run_data(cfg, log) if main else None
    barrier(dist_info)
    if not main:
        data = load_run_data(cfg, lambda m: None)
    cfg = cfg.replace(seq_len=data.seq_len, vocab_size=data.vocab_size)
    log(f"data: {data.description}")

    model = build_model(cfg, data.vocab_size, device)
    max_len = model.config.max_seq_len
    for ds in (data.train, data.val):
        ds.check_max_seq_len(max_len)
    model_id = model_id_for(cfg.model_size, cfg.arch)
    n_params, n_params_ne = _param_counts(model)
    log(
        f"model: {cfg.arch} {cfg.model_size} preset, {n_params / 1e6:.2f}M parameters, "
        f"vocab {data.vocab_size}, device {device}, {cfg.precision}, world size {dist_info.world_size}"
    )

    if cfg.fsdp and not dist_info.enabled:
        raise HydraTrainError(
            "--fsdp shards across processes: launch with torchrun --nproc_per_node=N (N >= 2)"
        )
    wrapped = wrap_model(
        model, dist_info, fsdp=cfg.fsdp, device=device, find_unused_parameters=cfg.ddp_find_unused_parameters
    )
    choice = build_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
        eight_bit=False,  # --8bit_adam is SafeOptimizations' to pretest and switch (state carried over)
        log=lambda m: console.print(Text(m, style="yellow")) if main else None,
    )
    schedule = LRSchedule.from_config(choice.optimizer, cfg)
    plan = BatchPlan(
        data.train, cfg.batch_size, seed=cfg.seed, rank=dist_info.rank, world_size=dist_info.world_size
    )
    loader = Prefetcher(
        plan.batch,
        0,
        threads=cfg.experimental_prefetch_threads,
        buffer_size=cfg.prefetch_buffer_size,
        device=device,
    )
    val = eval_batches(
        data.val, cfg.batch_size, cfg.eval_batches, rank=dist_info.rank, world_size=dist_info.world_size
    )

    found = None
    if main:
        if cfg.resume:  # found and checked before anything in the folder changes: a refusal changes nothing
            found = find_resume_checkpoint(ckpt_dir, log=log)
            if found is not None:
                check_model_config(found.checkpoint, model.config, found.path)
        _keep_tokenizer_beside(data.tokenizer_path, ckpt_dir, log)
    run_id = broadcast_object(dist_info, _new_run_id(model_id))
    artifacts = RunArtifacts(ckpt_dir / "runs" / run_id, rank=dist_info.rank)
    db = TrainingDB(ckpt_dir / DB_NAME) if main else None
    from hydra_train.safe_opts.callback import SafeOptimizations

    safe = next((cb for cb in extra if isinstance(cb, SafeOptimizations)), None)
    if safe is None:
        safe = SafeOptimizations(
            cfg,
            log=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True) if main else None,
        )
    safe.configure(cfg)
    # first, so that its pretests run before the progress bar starts
    cbs = CallbackList([safe, *(cb for cb in extra if cb is not safe)])
    db_cb = None
    if main:
        db_cb = MetricsDBCallback(db, run_id, ckpt_dir, announce_commits=announce_commits)
        cbs.add(db_cb)
        if cfg.progress:
            cbs.add(ProgressCallback(console, cfg.max_steps))
        if cfg.tensorboard:
            cbs.add(TensorBoardCallback(str(artifacts.folder / "tensorboard")))
        if cfg.wandb:
            cbs.add(WandbCallback(str(artifacts.folder), run_id, cfg.to_dict()))
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
        payload = tr.checkpoint_payload(model.config.to_dict())
        if not main:
            return None
        path = ckpt_dir / (final_name(model_id) if final else step_name(model_id, tr.step))
        check_finite_weights(payload["model"], tr.step)
        save_checkpoint(payload, path)
        removed = prune_checkpoints(ckpt_dir, model_id, cfg.keep_checkpoints)
        db_cb.export()
        log(f"saved {path}" + (f" (removed {', '.join(p.name for p in removed)})" if removed else ""))
        return path

    trainer.saver = saver

    resumed_from = None
    resume_step = None
    if cfg.resume:
        path = broadcast_object(dist_info, str(found.path) if found else None)
        if path is None:
            log(f"--resume: no checkpoint in {ckpt_dir} yet; starting from scratch")
        else:
            if found is None:
                from hydra_train.checkpoint import ResumePoint, load_checkpoint

                ck = load_checkpoint(path)
                found = ResumePoint(Path(path), int(ck["step"]), ck)
            trainer.resume_from(found)
            resume_step = found.step
            resumed_from = found.checkpoint.get("run_id")
            safe.checkpoint = f"{found.path}@{found.step}"  # a new checkpoint: pretests rerun
            log(f"resuming from {found.path} (step {found.step}, run {resumed_from})")
            found = None  # drop the loaded checkpoint's tensors

    if main:
        settle_dead_runs(db, model_id, resume_step, log)
        db.upsert_model(model_id, cfg.model_size, n_params, n_params_ne, model.config.to_dict())
        db.start_run(
            run_id,
            model_id,
            trainer.step,
            cfg.to_dict(),
            resumed_from=resumed_from,
            device=str(device),
            world_size=dist_info.world_size,
        )
    if trainer.step >= cfg.max_steps:
        log(f"the checkpoint is at step {trainer.step} >= --max_steps {cfg.max_steps}; nothing to train")
    start_step = trainer.step
    summary: dict[str, Any] = {}
    try:
        summary = trainer.train()
        if trainer.step > start_step:
            try:
                summary["final_checkpoint"] = str(trainer.save_checkpoint(final=True))
            except BaseException:
                trainer.status = summary["status"] = "failed"
                raise
    finally:
        if not summary:
            summary = trainer.summary()
        summary.update(
            arch=cfg.arch,
            model_size=cfg.model_size,
            params=n_params,
            device=str(device),
            precision=cfg.precision,
            world_size=dist_info.world_size,
            checkpoint_dir=str(ckpt_dir),
            run_dir=str(artifacts.folder),
            database=str(ckpt_dir / DB_NAME),
            optimizer=choice.name,
            optimizer_note=choice.note,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            grad_accum=cfg.grad_accum,
            data=data.description,
            resumed_from=resumed_from,
            compile=cfg.compile,
            triton_kernels=cfg.triton_kernels,
            chunked_ce=cfg.chunked_ce,
            fsdp=cfg.fsdp,
        )
        if hasattr(model, "flops_per_token") and summary.get("tokens_per_s"):
            fpt = float(model.flops_per_token(cfg.seq_len, executed=True))
            summary["tflops_per_s"] = summary["tokens_per_s"] * fpt / 1e12
        if device.type == "cuda":
            summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        cbs.call("on_train_end", summary)
        if db is not None:
            db.close()
        out = os.environ.get("OUT")
        if main and out and Path(out).is_dir():
            (Path(out) / f"train_summary_{model_id}_{run_id}.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (label, value) rows for the table the CLI prints."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    rows = [
        ("status", s.get("status", "-")),
        (
            "model",
            f"{s.get('arch', 'hydra')} {s.get('model_size')} ({f(s.get('params', 0) / 1e6, '.2f')}M params), "
            f"{s.get('device')}, "
            f"{s.get('precision')}, world size {s.get('world_size')}",
        ),
        ("data", str(s.get("data"))),
        (
            "steps",
            f"{s.get('steps')} ({f(s.get('tokens_seen'), ',d')} tokens, batch {s.get('batch_size')} x "
            f"{s.get('seq_len')} x accum {s.get('grad_accum')}), skipped {s.get('skipped_steps')}",
        ),
        (
            "validation loss",
            f"{f(s.get('first_val_loss'), '.4f')} -> {f(s.get('final_val_loss'), '.4f')} "
            f"(best {f(s.get('best_val_loss'), '.4f')})",
        ),
        ("train loss (last)", f(s.get("final_loss"), ".4f")),
        (
            "tokens/s",
            f"{f(s.get('tokens_per_s'), ',.0f')} "
            f"(mean over training time {f(s.get('train_time_s'), '.1f')} s;"
            f" last interval {f(s.get('tokens_per_s_last'), ',.0f')})",
        ),
    ]
    if s.get("tflops_per_s") is not None:
        rows.append(("model TFLOP/s", f"{s['tflops_per_s']:.2f} (executed FLOPs)"))
    if s.get("peak_memory_gib") is not None:
        rows.append(("peak memory", f"{s['peak_memory_gib']:.2f} GiB allocated"))
    else:
        rows.append(("peak memory", f"{f(s.get('memory_mb'), ',.0f')} MiB resident (process)"))
    rows.append(
        (
            "optimizer",
            s.get("optimizer", "-") + (f" ({s['optimizer_note']})" if s.get("optimizer_note") else ""),
        )
    )
    if s.get("safe_opts"):
        on = [n for n, st in s["safe_opts"].items() if st in ("ENABLED", "STABLE")]
        off = [f"{n} {st}" for n, st in s["safe_opts"].items() if st not in ("ENABLED", "STABLE", "OFF")]
        rows.append(("optimizations", f"on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"))
    rows += [
        ("checkpoint", str(s.get("final_checkpoint", "-"))),
        ("metrics database", str(s.get("database"))),
        ("run artifacts", str(s.get("run_dir"))),
    ]
    return rows
