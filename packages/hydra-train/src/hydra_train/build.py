"""Building a run's parts from its configuration: the data, the model (flags checked before any
data is read), the optimizer with its schedule. ``hydra-train run`` and ``hydra-train pretest``
build through the same functions, so a pretest measures the model training would use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hydra_train.config import TrainConfig
from hydra_train.config_model import check_model_flags, model_overrides, preset_vocab_size
from hydra_train.data_sources import load_data
from hydra_train.errors import HydraTrainError
from hydra_train.optim import LRSchedule, OptimizerChoice, build_optimizer
from hydra_train.options import torchrun_launch


def load_run_data(cfg: TrainConfig, log: Callable[[str], None]) -> Any:
    """The data ``cfg`` names (--dataset, --seq_len, --tokenizer), tokenized to --vocab_size or,
    without one, to the preset's vocabulary; a batch bigger than the data is warned about here."""
    data = load_data(
        cfg.data.dataset,
        seq_len=cfg.data.seq_len,
        vocab_size=cfg.model.vocab_size,
        default_vocab=preset_vocab_size(cfg.model.model_size),
        tokenizer=cfg.data.tokenizer,
        text_column=cfg.data.text_column,
        log=log,
    )
    note = batch_repeats_note(
        data.train.num_windows, data.seq_len, cfg.data.batch_size, torchrun_launch().world_size
    )
    if note:
        log(note)
    return data


def batch_repeats_note(windows: int, seq_len: int, batch_size: int, world_size: int = 1) -> str | None:
    """A warning when one step's batch (every process's) holds more sequences than the training data
    has windows: the batch order (dataset.BatchPlan) then wraps within a batch, and each batch
    repeats every window; accepted, since a tiny test set may be meant, but said once."""
    per_step = batch_size * world_size
    if per_step <= windows:
        return None
    across = f" ({batch_size} per process x {world_size})" if world_size > 1 else ""
    return (
        f"warning: the training data has {windows:,} windows of {seq_len} tokens; a batch of "
        f"{per_step} sequences{across} holds each window {per_step / windows:.1f} times on average "
        f"(use a --batch_size of {max(1, windows // world_size)} or less, or more data)"
    )


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    """The ``--arch`` model for ``cfg`` (preset + flags + ``model_overrides``) on ``device``."""
    import hydra_model

    check_model_flags(cfg)
    try:
        # made and initialised where it trains: on the host a 1B preset's init took seconds
        with torch.device(device):
            model = hydra_model.build_model(
                cfg.model.arch, cfg.model.model_size, **model_overrides(cfg, vocab_size)
            )
    except ValueError as exc:
        raise HydraTrainError(f"model config: {exc}") from None
    if cfg.model.checkpoint_every:
        model.enable_gradient_checkpointing(every=cfg.model.checkpoint_every)
    return model.to(device)


def param_counts(model) -> tuple[int, int]:
    """(all parameters, parameters without the embeddings)."""
    if hasattr(model, "num_parameters"):
        return model.num_parameters(), model.num_parameters(exclude_embeddings=True)
    n = sum(p.numel() for p in model.parameters())
    return n, n


def build_optimizer_and_schedule(
    model: torch.nn.Module, cfg: TrainConfig, log: Callable[[str], None] | None = None
) -> tuple[OptimizerChoice, LRSchedule]:
    """Fused AdamW (torch's; ``--8bit_adam`` is SafeOptimizations' to pretest and switch, with the
    state carried over) and the ``--lr_schedule`` attached to it."""
    choice = build_optimizer(
        model,
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eight_bit=False,
        log=log,
    )
    note = warmup_note(cfg.optim.warmup_steps, cfg.runtime.max_steps)
    if note and log is not None:
        log(note)
    return choice, LRSchedule.from_config(choice.optimizer, cfg)


def warmup_note(warmup_steps: int, max_steps: int) -> str | None:
    """A warning when --warmup_steps is longer than the run: the learning rate is still climbing at
    the last step (``LRSchedule.factor``: (step + 1) / warmup) and never decays. Accepted (a run
    continued later with a larger --max_steps may want it), but said."""
    if warmup_steps <= max_steps:
        return None
    return (
        f"warning: --warmup_steps {warmup_steps} is more than --max_steps {max_steps}: the learning rate "
        f"never reaches its peak --lr (the last step's is {max_steps / warmup_steps:.0%} of it) and "
        f"never decays; use a --warmup_steps below {max_steps}"
    )
