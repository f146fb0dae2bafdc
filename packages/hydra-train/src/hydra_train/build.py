"""Building a run's parts from its configuration: the data, the model (flags checked before any
data is read), the optimizer with its schedule. ``hydra-train run`` and ``hydra-train pretest``
build through the same functions, so a pretest measures the model training would use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hydra_train.config import TrainConfig
from hydra_train.data_sources import load_data
from hydra_train.errors import HydraTrainError
from hydra_train.optim import LRSchedule, OptimizerChoice, build_optimizer


def preset_vocab_size(model_size: str) -> int:
    """The vocabulary the preset defines (HydraConfig's default when it names none): what the data
    is tokenized to when --vocab_size is not given."""
    from hydra_model import MODEL_PRESETS, HydraConfig

    return MODEL_PRESETS.get(model_size, {}).get("vocab_size", HydraConfig.vocab_size)


def load_run_data(cfg: TrainConfig, log: Callable[[str], None]) -> Any:
    """The data ``cfg`` names (--dataset, --seq_len, --tokenizer), tokenized to --vocab_size or,
    without one, to the preset's vocabulary."""
    return load_data(
        cfg.data.dataset,
        seq_len=cfg.data.seq_len,
        vocab_size=cfg.model.vocab_size,
        default_vocab=preset_vocab_size(cfg.model.model_size),
        tokenizer=cfg.data.tokenizer,
        text_column=cfg.data.text_column,
        log=log,
    )


def model_overrides(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The HydraConfig fields the training flags set (``--model_override`` last, so it wins)."""
    overrides: dict[str, Any] = {"vocab_size": vocab_size}
    if cfg.model.chunked_ce:
        overrides["use_chunked_ce"] = True
    if cfg.model.static_routing_mode:
        overrides["static_routing_mode"] = True
    if cfg.model.moe:
        overrides.update(moe_enabled=True, moe_num_experts=cfg.model.moe_num_experts)
    overrides.update(cfg.model.model_overrides)
    return overrides


def check_model_flags(cfg: TrainConfig) -> None:
    """The model flags (--model_size, --model_override, ...) checked before any data is read, so that
    a typo is reported at once instead of after the corpus is tokenized."""
    import hydra_model

    sizes = hydra_model.MODEL_PRESETS  # both architectures have these preset names
    if cfg.model.model_size not in sizes:
        raise HydraTrainError(
            f"--model_size {cfg.model.model_size!r} is not a preset; choose from {', '.join(sizes)}"
        )
    vocab = cfg.model.vocab_size or preset_vocab_size(cfg.model.model_size)  # the data may change it later
    try:
        hydra_model.build_config(cfg.model.arch, cfg.model.model_size, **model_overrides(cfg, vocab))
    except (ValueError, TypeError) as exc:
        raise HydraTrainError(f"model config: {exc}") from None


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
    return choice, LRSchedule.from_config(choice.optimizer, cfg)
