"""The flags that decide the model, checked against the model config they build, before any data
is read (:func:`hydra_train.config.resolve_config` calls :func:`check_model_flags`; so does
``build_model``). A preset that does not exist, a ``--model_override`` of an unknown field or of a
value the config refuses, and a ``--seq_len`` longer than the model's ``max_seq_len`` are usage
errors (exit 2): the value alone decides, so they are refused before the corpus is tokenized.
Refusals that need the data (its vocabulary, a row-shaped file's length) stay with the data.

No torch at import: hydra_model is imported when a check runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hydra_train.errors import HydraUsageError

if TYPE_CHECKING:
    from hydra_train.config import TrainConfig


def preset_vocab_size(model_size: str) -> int:
    """The vocabulary the preset defines (HydraConfig's default when it names none): what the data
    is tokenized to when --vocab_size is not given."""
    from hydra_model import MODEL_PRESETS, HydraConfig

    return MODEL_PRESETS.get(model_size, {}).get("vocab_size", HydraConfig.vocab_size)


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


def check_model_flags(cfg: TrainConfig) -> Any:
    """The model config that --arch, --model_size, --model_override (and the flags that set model
    fields) give, or a usage error naming the flag. Returns the config (its ``max_seq_len`` is
    what :func:`check_seq_len` compares with)."""
    import hydra_model

    sizes = hydra_model.MODEL_PRESETS  # both architectures have these preset names
    size = cfg.model.model_size
    if size not in sizes:
        # "100m" is the model id of "100M" (checkpoint names, the database): say which preset it is
        near = next((s for s in sizes if s.lower() == str(size).lower()), None)
        hint = f" (did you mean {near}?)" if near else ""
        raise HydraUsageError(f"--model_size {size!r} is not a preset{hint}; choose from {', '.join(sizes)}")
    vocab = cfg.model.vocab_size or preset_vocab_size(size)  # the data may change it later
    try:
        return hydra_model.build_config(cfg.model.arch, size, **model_overrides(cfg, vocab))
    except (ValueError, TypeError) as exc:
        raise HydraUsageError(f"model config: {exc}") from None


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Windows of ``seq_len`` tokens must fit the model's positions; the message says both ways out."""
    if seq_len > max_seq_len:
        raise HydraUsageError(
            f"--seq_len {seq_len} is longer than the model's max_seq_len {max_seq_len}; pass "
            f"--seq_len {max_seq_len} or less, or give the model more positions with "
            f"--model_override max_seq_len={seq_len}"
        )
