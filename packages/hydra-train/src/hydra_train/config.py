"""TrainConfig: a run's one configuration (five sections, :mod:`hydra_train.config_options`),
parsed once by the CLI for ``run`` and ``pretest`` alike, and how "auto" values resolve.

A field left at ``None`` (or ``"auto"``) is chosen by :func:`resolve_config` from the device and
the mode, so that ``hydra-train run`` with no arguments finishes in minutes on a laptop CPU and
uses a larger preset with bf16 on a GPU. The resolved config (no ``None`` left in the fields that
have automatic values) is what the trainer uses and what checkpoints store (flat) under
``config["train"]``.

SafeOptimizations' fields (``experimental_*``, ``cuda_graphs_warmup``, ``fp8_*``, ``compile_scope``,
``pretest_*``) say what is *requested*; :mod:`hydra_train.safe_opts` pretests and monitors each one
and decides what actually runs. ``to_dict``/``from_dict`` carry any field, and unknown keys in an
old checkpoint are ignored.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from hydra_train.compile_defaults import compile_by_default, compile_reason, compile_scope_for
from hydra_train.config_defaults import LR_BY_SIZE, PRODUCTION_DEFAULTS, TESTING_DEFAULTS
from hydra_train.config_model import check_model_flags, check_seq_len
from hydra_train.config_options import (
    SECTIONS,
    DataOptions,
    ModelOptions,
    OptimizationOptions,
    OptimOptions,
    RuntimeOptions,
)
from hydra_train.errors import HydraTrainError, HydraUsageError

__all__ = [
    "DataOptions",
    "DeviceInfo",
    "ModelOptions",
    "OptimOptions",
    "OptimizationOptions",
    "RuntimeOptions",
    "TrainConfig",
    "compile_reason",
    "model_id_for",
    "resolve_config",
]

MODES = ("testing", "production")
SCHEDULES = ("cosine", "wsd")
PRECISIONS = ("auto", "bf16", "fp32")
FP8_FORMATS = ("e4m3", "e5m2")
FP8_SCALINGS = ("row", "tensor")
COMPILE_SCOPES = ("auto", "blocks", "model")
GRAD_SYNC_MODES = ("auto", "reducer", "allreduce")  # hydra_train.data_parallel says what each does

#: Default corpus names that need no files: the Python standard library's own source, and "pyenv"
#: (every .py of the standard library and installed packages; hydra_train.pyenv_corpus).
EMBEDDED_CORPORA = ("stdlib", "stdlib-full", "pyenv")  # see hydra_train.corpus


#: flat field name -> the section that holds it (``batch_size`` -> ``data``)
FIELD_SECTIONS: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}


class TrainConfig:
    """Every knob of a training run, in five sections (:mod:`hydra_train.config_options`):
    ``cfg.model``, ``cfg.optim``, ``cfg.data``, ``cfg.runtime``, ``cfg.optimizations``.

    A field reads and writes under its own name too (``cfg.batch_size`` is ``cfg.data.batch_size``;
    field names are unique across sections), so ``TrainConfig(batch_size=8, lr=1e-3)`` and
    ``cfg.replace(resume=True)`` need no section. ``to_dict`` is flat, as checkpoints, the metrics
    database and ``--dry_run`` have always stored it."""

    __slots__ = tuple(SECTIONS)

    def __init__(self, **values: Any) -> None:
        for section, cls in SECTIONS.items():
            given = values.pop(section, None)
            object.__setattr__(self, section, given if given is not None else cls())
        for name, value in values.items():
            if name not in FIELD_SECTIONS:
                raise TypeError(f"TrainConfig has no field {name!r}")
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        section = FIELD_SECTIONS.get(name)
        if section is None:
            raise AttributeError(f"TrainConfig has no field {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTIONS:
            object.__setattr__(self, name, value)
        elif name in FIELD_SECTIONS:
            setattr(getattr(self, FIELD_SECTIONS[name]), name, value)
        else:
            raise AttributeError(f"TrainConfig has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainConfig) and all(getattr(self, s) == getattr(other, s) for s in SECTIONS)

    def __repr__(self) -> str:
        return "TrainConfig(" + ", ".join(f"{s}={getattr(self, s)!r}" for s in SECTIONS) + ")"

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every field's flat name, section by section."""
        return tuple(FIELD_SECTIONS)

    def to_dict(self) -> dict[str, Any]:
        """Flat: ``{"arch": ..., "batch_size": ..., ...}``."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, section)))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a flat dict; keys this version does not know (an older or newer run) are ignored."""
        return cls(**{k: v for k, v in d.items() if k in FIELD_SECTIONS})

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy (sections copied too) with ``changes`` (flat names or whole sections) applied."""
        new = copy.deepcopy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new


@dataclass(frozen=True)
class DeviceInfo:
    """What :func:`resolve_config` needs to know about the machine."""

    type: str  # "cpu" or "cuda"
    total_memory_gib: float = 0.0
    bf16_supported: bool = False


def _size_for(dev: DeviceInfo) -> str:
    if dev.type != "cuda":
        return "tiny"
    if dev.total_memory_gib >= 40:
        return "100M"
    if dev.total_memory_gib >= 12:
        return "debug"
    return "tiny"


def check_numbers(cfg: TrainConfig) -> None:
    """Every numeric field is a finite number (NaN and inf pass no range check): a usage error."""
    import math

    for name, value in cfg.to_dict().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise HydraUsageError(f"--{name} must be a finite number, got {value}")
    if cfg.weight_decay < 0:
        raise HydraUsageError(f"--weight_decay must be >= 0, got {cfg.weight_decay}")
    if cfg.max_skipped_steps < 1:
        raise HydraUsageError(f"--max_skipped_steps must be >= 1, got {cfg.max_skipped_steps}")
    if cfg.vocab_size is not None and cfg.vocab_size < 2:
        raise HydraUsageError(f"--vocab_size must be >= 2, got {cfg.vocab_size}")
    for name in ("beta1", "beta2"):
        v = getattr(cfg, name, None)
        if v is not None and not 0.0 <= v < 1.0:
            raise HydraUsageError(f"--{name} must be in [0, 1), got {v}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise HydraUsageError(f"--{name} {value!r} is not one of: {', '.join(allowed)}")


def _check_positive(cfg: TrainConfig, names: tuple[str, ...], allow_zero: tuple[str, ...] = ()) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        if v < 0 or (v == 0 and name not in allow_zero):
            raise HydraUsageError(f"--{name} must be {'>= 0' if name in allow_zero else '> 0'}, got {v}")


def _check_safe_opts(cfg: TrainConfig) -> None:
    _check_choice("fp8_format", cfg.fp8_format, FP8_FORMATS)
    _check_choice("fp8_scaling", cfg.fp8_scaling, FP8_SCALINGS)
    _check_choice("compile_scope", cfg.compile_scope, COMPILE_SCOPES)
    _check_positive(
        cfg,
        (
            "cuda_graphs_warmup",
            "triton_block_q",
            "triton_block_kv",
            "triton_num_warps",
            "experimental_safety_window",
            "experimental_loss_spike_threshold",
            "experimental_throughput_drop_threshold",
            "pretest_steps",
            "pretest_warmup_steps",
        ),
        allow_zero=("pretest_warmup_steps",),
    )
    if cfg.experimental_loss_spike_threshold <= 1.0:
        raise HydraUsageError(
            f"--experimental_loss_spike_threshold must be > 1 (a multiple of the loss EMA), "
            f"got {cfg.experimental_loss_spike_threshold}"
        )
    if cfg.experimental_throughput_drop_threshold >= 1.0:
        raise HydraUsageError(
            "--experimental_throughput_drop_threshold must be in (0, 1) (a fraction of the tokens/s "
            f"EMA), got {cfg.experimental_throughput_drop_threshold}"
        )


def _check_arch(cfg: TrainConfig) -> None:
    """--arch names an architecture, and the routing flags only go with HYDRA."""
    from hydra_model import ARCHITECTURES

    _check_choice("arch", cfg.arch, ARCHITECTURES)
    if cfg.arch != "hydra":
        for flag, value in (("moe", cfg.moe), ("static_routing_mode", cfg.static_routing_mode)):
            if value:
                raise HydraUsageError(
                    f"--{flag} applies to --arch hydra only; --arch {cfg.arch} has no routing"
                )


def resolve_config(cfg: TrainConfig, dev: DeviceInfo) -> TrainConfig:
    """Fill every automatic field for device ``dev`` and validate the rest."""
    check_numbers(cfg)
    _check_choice("mode", cfg.mode, MODES)
    _check_choice("lr_schedule", cfg.lr_schedule, SCHEDULES)
    _check_choice("precision", cfg.precision, PRECISIONS)
    _check_positive(
        cfg,
        (
            "max_steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "lr",
            "eval_every",
            "log_every",
            "save_every",
            "keep_checkpoints",
            "eval_batches",
            "moe_num_experts",
            "prefetch_buffer_size",
            "cpu_threads",
            "checkpoint_every",
            "experimental_prefetch_threads",
            "warmup_steps",
            "grad_clip",
        ),
        allow_zero=(
            "checkpoint_every",
            "experimental_prefetch_threads",
            "warmup_steps",
            "grad_clip",
            "keep_checkpoints",
            "save_every",
        ),
    )
    _check_safe_opts(cfg)
    _check_arch(cfg)
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise HydraUsageError(f"--min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if not 0.0 < cfg.wsd_decay_frac <= 1.0:
        raise HydraUsageError(f"--wsd_decay_frac must be in (0, 1], got {cfg.wsd_decay_frac}")

    kind = "cuda" if dev.type == "cuda" else "cpu"
    base = dict(TESTING_DEFAULTS[kind])
    if cfg.mode == "production":
        base.update(PRODUCTION_DEFAULTS)
    out = cfg.replace()
    if out.model_size == "auto":
        out.model_size = _size_for(dev)
    if out.dataset == "auto":
        out.dataset = base["dataset"]
    if out.vocab_size is None and out.dataset in EMBEDDED_CORPORA:
        out.vocab_size = base["vocab_size"]
    for name in ("seq_len", "batch_size", "max_steps", "eval_every", "log_every", "save_every"):
        if getattr(out, name) is None:
            setattr(out, name, base[name])
    if out.lr is None:
        out.lr = LR_BY_SIZE.get(out.model_size, base["lr"])
    if out.warmup_steps is None:
        out.warmup_steps = max(1, min(1000, out.max_steps // 20))
    if out.triton_kernels is None:
        out.triton_kernels = kind == "cuda"
    if out.chunked_ce is None:
        out.chunked_ce = kind == "cuda"
    if out.compile is None:
        out.compile = compile_by_default(out, kind)
    if out.compile_scope == "auto":
        # fixed when nothing compiles: the scope is part of the pretest log's fingerprint
        out.compile_scope = compile_scope_for(out) if out.compile else "blocks"
    if out.precision == "auto":
        out.precision = "bf16" if (kind == "cuda" and dev.bf16_supported) else "fp32"
    if out.precision == "bf16" and kind != "cuda":
        raise HydraTrainError("--precision bf16 needs a CUDA device; use --precision fp32 on the CPU")
    _check_choice("ddp_grad_sync", out.ddp_grad_sync, GRAD_SYNC_MODES)
    if out.ddp_grad_sync == "allreduce" and out.fsdp:
        raise HydraUsageError(
            "--ddp_grad_sync allreduce is for DDP; FSDP2 reduces its sharded gradients itself (drop one)"
        )
    if out.ddp_grad_sync == "allreduce" and out.ddp_find_unused_parameters:
        # the hand-rolled all-reduce gives an unused parameter a zero gradient where DDP's reducer,
        # finding it unused on every rank, leaves it without one
        raise HydraUsageError("--ddp_grad_sync allreduce does not support ddp_find_unused_parameters")
    if out.fsdp and out.compile and out.compile_scope == "model":
        # FSDP2's gathers run in hooks around each block, which a whole-forward graph would break on
        raise HydraUsageError(
            "--fsdp compiles each block: use --compile_scope blocks (or auto) with it, not model"
        )
    _check_against_model(cfg, out)
    return out


def _check_against_model(asked: TrainConfig, out: TrainConfig) -> None:
    """The refusals the flags' values decide alone, made here so that they come before the data is
    read or a tokenizer trained (a run logs nothing before this): the vocabulary a BPE is trained
    to, the model the flags build (config_model.py), the windows it must take."""
    if out.dataset in EMBEDDED_CORPORA:
        from hydra_train.tokenizer import MIN_VOCAB

        if out.vocab_size < MIN_VOCAB:
            raise HydraUsageError(
                f"--vocab_size {out.vocab_size} is too small for the byte-level BPE trained for "
                f"--dataset {out.dataset} (min {MIN_VOCAB}: 256 byte symbols, the end-of-document "
                "token and a few merges)"
            )
    model_config = check_model_flags(out)
    # a stream's windows are --seq_len long: with the embedded corpora, or when --seq_len is given,
    # the value decides; an automatic one on other data may be replaced by row-shaped data's own
    # length, checked once the data is read (dataset.check_max_seq_len)
    if asked.seq_len is not None or out.dataset in EMBEDDED_CORPORA:
        check_seq_len(out.seq_len, model_config.max_seq_len)


def model_id_for(size: str, arch: str = "hydra") -> str:
    """The id a model has in the metrics database and in checkpoint names: the size in lower
    case for HYDRA ("100m"), prefixed by any other architecture ("gpt-100m")."""
    return size.lower() if arch == "hydra" else f"{arch}-{size.lower()}"
