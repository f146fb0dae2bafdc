"""TrainConfig: every flag of ``hydra-train run`` in one dataclass, and how "auto" values resolve.

A field left at ``None`` (or ``"auto"``) is chosen by :func:`resolve_config` from the device and
the mode, so that ``hydra-train run`` with no arguments finishes in minutes on a laptop CPU and
uses a larger preset with bf16 on a GPU. The resolved config (no ``None`` left in the fields that
have automatic values) is what the trainer uses and what checkpoints store under
``config["train"]``.

SafeOptimizations' fields (``experimental_*``, ``cuda_graphs_warmup``, ``fp8_*``, ``compile_scope``,
``pretest_*``) say what is *requested*; :mod:`hydra_train.safe_opts` pretests and monitors each one
and decides what actually runs. ``to_dict``/``from_dict`` carry any field, and unknown keys in an
old checkpoint are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra_train.errors import HydraTrainError, HydraUsageError

MODES = ("testing", "production")
SCHEDULES = ("cosine", "wsd")
PRECISIONS = ("auto", "bf16", "fp32")
FP8_FORMATS = ("e4m3", "e5m2")
FP8_SCALINGS = ("row", "tensor")
COMPILE_SCOPES = ("blocks", "model")

#: Default corpus names that need no files: the Python standard library's own source, and "pyenv"
#: (every .py of the standard library and installed packages; hydra_train.pyenv_corpus).
EMBEDDED_CORPORA = ("stdlib", "stdlib-full", "pyenv")  # see hydra_train.corpus


@dataclass
class TrainConfig:
    """Every knob of a training run. ``None``/``"auto"`` means: pick for this device and mode."""

    # model
    #: "hydra" (CCGQA + MoD/MoR routing) or "gpt" (the dense baseline); hydra_model.ARCHITECTURES
    arch: str = "hydra"
    model_size: str = "auto"
    moe: bool = False
    moe_num_experts: int = 4
    static_routing_mode: bool = False
    #: fused linear + cross-entropy; None = on with CUDA, off on the CPU (the fast path by default)
    chunked_ce: bool | None = None
    vocab_size: int | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # run length and batch
    mode: str = "testing"
    max_steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    # optimizer and schedule
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    lr_schedule: str = "cosine"
    wsd_decay_frac: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    #: stop as failed after this many optimizer steps in a row skipped for non-finite loss/gradients
    max_skipped_steps: int = 3
    eight_bit_adam: bool = False
    # memory and speed
    checkpoint_every: int = 0
    #: hydra-kernels' Triton ops; None = on with CUDA (pretested by SafeOptimizations), off on the CPU
    triton_kernels: bool | None = None
    compile: bool = False
    precision: str = "auto"
    device: str = "auto"
    cpu_threads: int | None = None
    fsdp: bool = False
    ddp_find_unused_parameters: bool = False
    # data
    dataset: str = "auto"
    tokenizer: str | None = None
    text_column: str = "text"
    experimental_prefetch_threads: int = 4
    prefetch_buffer_size: int = 8
    # evaluation, logging, saving
    eval_every: int | None = None
    eval_batches: int = 8
    log_every: int | None = None
    save_every: int | None = None
    keep_checkpoints: int = 3
    checkpoint_dir: str = "checkpoints"
    resume: bool = False
    seed: int = 1337
    tensorboard: bool = False
    wandb: bool = False
    progress: bool = True
    # SafeOptimizations (hydra_train.safe_opts): what is requested; pretests and the monitor decide
    experimental_fa3: bool = True
    experimental_cuda_graphs: bool = True
    cuda_graphs_warmup: int = 50
    experimental_blackwell_tuning: bool = True
    triton_block_q: int | None = None
    triton_block_kv: int | None = None
    triton_num_warps: int | None = None
    experimental_fp8: bool = False
    fp8_format: str = "e4m3"
    fp8_scaling: str = "row"
    compile_scope: str = "blocks"
    experimental_safety_window: int = 100
    experimental_loss_spike_threshold: float = 2.0
    experimental_throughput_drop_threshold: float = 0.5
    experimental_skip_pretest: bool = False
    pretest_warmup_steps: int = 2
    pretest_steps: int = 4

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a dict; keys this version does not know (an older or newer run) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


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


# Per device kind: (dataset, vocab, seq_len, batch, steps, lr, eval_every, log_every, save_every).
# The CPU row is sized so that the default run (tiny preset, the stdlib corpus) finishes in a few
# minutes on a 2-core machine with the validation loss far below its start; see the README.
_TESTING_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(
        dataset="stdlib",
        vocab_size=4096,
        seq_len=128,
        batch_size=8,
        max_steps=120,
        lr=3e-3,
        eval_every=40,
        log_every=5,
        save_every=60,
    ),
    "cuda": dict(
        dataset="stdlib-full",
        vocab_size=32000,
        seq_len=1024,
        batch_size=16,
        max_steps=300,
        lr=1e-3,
        eval_every=100,
        log_every=10,
        save_every=300,
    ),
}
_PRODUCTION_DEFAULTS: dict[str, Any] = dict(max_steps=100_000, eval_every=1000, log_every=50, save_every=1000)
_LR_BY_SIZE = {"tiny": 3e-3, "debug": 1e-3, "100M": 6e-4, "250M": 5e-4, "500M": 4e-4, "1B": 3e-4}


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
        raise HydraTrainError(f"--{name} {value!r} is not one of: {', '.join(allowed)}")


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
        raise HydraTrainError(
            f"--experimental_loss_spike_threshold must be > 1 (a multiple of the loss EMA), "
            f"got {cfg.experimental_loss_spike_threshold}"
        )
    if cfg.experimental_throughput_drop_threshold >= 1.0:
        raise HydraTrainError(
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
                raise HydraTrainError(
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
    base = dict(_TESTING_DEFAULTS[kind])
    if cfg.mode == "production":
        base.update(_PRODUCTION_DEFAULTS)
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
        out.lr = _LR_BY_SIZE.get(out.model_size, base["lr"])
    if out.warmup_steps is None:
        out.warmup_steps = max(1, min(1000, out.max_steps // 20))
    if out.triton_kernels is None:
        out.triton_kernels = kind == "cuda"
    if out.chunked_ce is None:
        out.chunked_ce = kind == "cuda"
    if out.precision == "auto":
        out.precision = "bf16" if (kind == "cuda" and dev.bf16_supported) else "fp32"
    if out.precision == "bf16" and kind != "cuda":
        raise HydraTrainError("--precision bf16 needs a CUDA device; use --precision fp32 on the CPU")
    if out.fsdp and out.compile:
        # both work alone; together they need per-block compilation, which this runner does not do
        raise HydraTrainError("--fsdp and --compile cannot be combined yet; drop one of them")
    return out


def model_id_for(size: str, arch: str = "hydra") -> str:
    """The id a model has in the metrics database and in checkpoint names: the size in lower
    case for HYDRA ("100m"), prefixed by any other architecture ("gpt-100m")."""
    return size.lower() if arch == "hydra" else f"{arch}-{size.lower()}"
