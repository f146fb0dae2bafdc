"""``hydra-train pretest``: the pretests alone, on the model ``hydra-train run`` would build.

The model, optimizer, schedule and precision are built exactly as for training (same presets,
flags and defaults); only the data differs by default: random tokens (``--dataset random``, fresh
per batch index and seed, never zeros), so that a pretest needs no corpus or tokenizer on the
machine. ``--dataset NAME`` uses the training data instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hydra_train.callbacks import CallbackList
from hydra_train.config import TrainConfig, resolve_config
from hydra_train.prefetch import Prefetcher
from hydra_train.safe_opts.activation import graph_modes_for
from hydra_train.safe_opts.faults import FaultInjector
from hydra_train.safe_opts.pretest import PretestRunner, PretestSettings
from hydra_train.safe_opts.pretest_log import PretestHook, environment, fingerprint
from hydra_train.safe_opts.registry import NAMES, build_registry
from hydra_train.trainer import Trainer

RANDOM = "random"


@dataclass
class RandomBatches:
    """Batch k: uniform random tokens from a generator seeded by (seed, k); a pure function of k."""

    batch_size: int
    seq_len: int
    vocab_size: int
    seed: int

    def __call__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(k))
        toks = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def request_all(cfg: TrainConfig) -> TrainConfig:
    """The config with every optimization requested (``hydra-train pretest --all``)."""
    return cfg.replace(
        experimental_fa3=True,
        experimental_cuda_graphs=True,
        experimental_blackwell_tuning=True,
        experimental_prefetch_threads=cfg.optimizations.experimental_prefetch_threads or 4,
        experimental_fp8=True,
        triton_kernels=True,
        compile=True,
        eight_bit_adam=True,
        static_routing_mode=cfg.model.arch == "hydra",  # the other architectures have no routing
    )


def build_trainer(cfg: TrainConfig, log: Callable[[str], None]) -> tuple[Trainer, Callable, TrainConfig]:
    from hydra_train.build import (
        build_model,
        build_optimizer_and_schedule,
        check_model_flags,
        load_run_data,
        preset_vocab_size,
    )
    from hydra_train.device_setup import choose_cpu_threads, device_info, pick_device, seed_everything

    device = pick_device(cfg.runtime.device)
    random_data = cfg.data.dataset in (RANDOM, "auto")
    asked_vocab = cfg.model.vocab_size
    # random tokens train no BPE: the user's --vocab_size is not held to the tokenizer's minimum
    # (resolved as for stdlib, then put back)
    cfg = resolve_config(
        cfg.replace(dataset="stdlib", vocab_size=None) if random_data else cfg, device_info(device)
    )
    if random_data and asked_vocab is not None:
        cfg = cfg.replace(vocab_size=asked_vocab)
    check_model_flags(cfg)  # a bad --model_size is reported before any data is read
    if device.type == "cpu":
        torch.set_num_threads(choose_cpu_threads(cfg.runtime.cpu_threads)[0])
    seed_everything(cfg.runtime.seed)
    if random_data:
        vocab = cfg.model.vocab_size or preset_vocab_size(cfg.model.model_size)
        cfg = cfg.replace(dataset=RANDOM, vocab_size=vocab)
    else:
        data = load_run_data(cfg, log)
        cfg = cfg.replace(seq_len=data.seq_len, vocab_size=data.vocab_size)
    model = build_model(cfg, cfg.model.vocab_size, device)
    # ids the model's embedding holds: ``--model_override vocab_size`` may make it smaller than
    # the data's vocabulary, and on CUDA an id past it is a device-side assert
    vocab = model.config.vocab_size
    if random_data:
        make_batch: Callable = RandomBatches(cfg.data.batch_size, cfg.data.seq_len, vocab, cfg.runtime.seed)
    else:
        from hydra_train.dataset import BatchPlan

        data.train.check_vocab_size(vocab)
        make_batch = BatchPlan(data.train, cfg.data.batch_size, seed=cfg.runtime.seed).batch
    choice, schedule = build_optimizer_and_schedule(model, cfg)
    trainer = Trainer(
        model,
        cfg,
        optimizer=choice.optimizer,
        schedule=schedule,
        loader=Prefetcher(make_batch, 0, threads=0, device=device),
        val_batches=[],
        device=device,
        callbacks=CallbackList(),
        log=log,
    )
    return trainer, make_batch, cfg


def run_standalone(
    cfg: TrainConfig,
    *,
    only: list[str] | None = None,
    log_dir: str | None = None,
    log: Callable[[str], None] = print,
    injector: FaultInjector | None = None,
    arm_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Build, pretest every requested optimization (or ``only`` these), record, return the record."""
    trainer, make_batch, cfg = build_trainer(cfg, log)
    registry = build_registry(cfg)
    names = [n for n in NAMES if registry[n].requested() and (not only or n in only)]
    for n in only or []:
        if not registry[n].requested():  # --only alone does not request it: say so, not silence
            log(f"[SafeOpts] {n}: not requested, not pretested (add {registry[n].flag} or --all)")
    t0 = time.perf_counter()
    runner = PretestRunner(
        trainer,
        registry,
        make_batch=make_batch,
        start_index=0,
        settings=PretestSettings(
            cfg.optimizations.pretest_warmup_steps,
            cfg.optimizations.pretest_steps,
            arm_timeout_s=arm_timeout_s,
        ),
        injector=injector if injector is not None else FaultInjector.from_options(NAMES),
        log=log,
    )
    body = runner.run(names, graph_modes_for(cfg))
    env = environment(trainer.device)
    model_cfg = trainer.model.config.to_dict()
    rec = {
        "model_size": cfg.model.model_size,
        "fingerprint": fingerprint(model_cfg, cfg, env, None),
        "trigger": "hydra-train pretest",
        "checkpoint": None,
        "env": env,
        "config": {
            "model": model_cfg,
            "batch_size": cfg.data.batch_size,
            "seq_len": cfg.data.seq_len,
            "dataset": cfg.data.dataset,
            "params": trainer.model.num_parameters() if hasattr(trainer.model, "num_parameters") else None,
        },
        "requested": names,
        "source": "hydra-train pretest",
        "wall_s": time.perf_counter() - t0,
        **body,
    }
    hook = PretestHook(log_dir or f"{cfg.runtime.checkpoint_dir}/pretest_logs")
    rec["log_file"] = str(hook.record(rec))
    return rec
