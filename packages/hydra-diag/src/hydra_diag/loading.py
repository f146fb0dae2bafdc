"""Where diagnostics get their model and data: a fresh preset, a checkpoint, or a run folder; and
batches from a hydra-train dataset, a synthetic learnable stream, or uniform random tokens.

Checkpoints are read through hydra-train (:func:`hydra_train.checkpoint.load_checkpoint`, which
validates the format) and the model is rebuilt from the config stored in them, as the architecture
they record (HYDRA or the dense GPT). A ``save_pretrained`` folder goes through
:func:`hydra_model.persistence.load_pretrained`, which picks the class the same way.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hydra_diag.output import DiagError, DiagUsageError
from hydra_kernels.cli_support import AssignmentError, parse_assignments


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["dim=64", "moe_enabled=true"]`` → ``{"dim": 64, "moe_enabled": True}`` (JSON values, else text)."""
    try:
        return parse_assignments(items)
    except AssignmentError as exc:
        raise DiagUsageError(f"--set {exc.item!r}: expected FIELD=VALUE, e.g. dim=128") from None


def pick_device(pref: str = "auto") -> torch.device:
    """hydra-train's device rule (``auto``: CUDA when present); errors become :class:`DiagError`."""
    from hydra_train.errors import HydraTrainError
    from hydra_train.run import pick_device as train_pick_device

    try:
        return train_pick_device(pref)
    except HydraTrainError as exc:
        raise DiagError(str(exc)) from None


def require_cuda_device(tool: str) -> torch.device:
    """The current CUDA device, or :class:`DiagError` naming the tool (library-level CUDA check)."""
    if not torch.cuda.is_available():
        raise DiagError(
            f"{tool} needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False)."
        )
    return torch.device("cuda", torch.cuda.current_device())


def build_model(model_size: str, overrides: dict[str, Any] | None = None, device: torch.device | str = "cpu"):
    """A freshly initialised preset with ``overrides``; a preset that does not exist, an unknown
    field or a value the config refuses is a DiagUsageError (exit 2: the values alone decide)."""
    from hydra_model import create_ccgqa_mod_mor_model

    try:
        model = create_ccgqa_mod_mor_model(model_size, **(overrides or {}))
    except (ValueError, TypeError) as exc:
        raise DiagUsageError(f"model config: {exc}") from None
    return model.to(device)


@dataclass
class LoadedModel:
    """A model and where it came from (``train_config`` is the run's TrainConfig dict, if known)."""

    model: Any
    source: str
    step: int | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: Path | None = None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file or save_pretrained folder; a run folder gives its newest checkpoint."""
    from hydra_train.checkpoint import list_checkpoints

    p = Path(path).expanduser()
    if not p.exists():
        raise DiagError(f"checkpoint {p} does not exist")
    if p.is_file() or (p / "config.json").is_file():
        return p
    found = list_checkpoints(p)
    if not found:
        raise DiagError(
            f"{p} holds no hydra-train checkpoint (hydra_<model>_step<N>.pt / _final.pt) and no "
            "config.json of save_pretrained; pass a checkpoint file"
        )
    return max(found, key=lambda f: (f.stat().st_mtime, f.name))


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A hydra-train checkpoint dict (weights_only load, format checked); errors are DiagError."""
    from hydra_train.checkpoint import load_checkpoint
    from hydra_train.errors import HydraCheckpointError

    try:
        return load_checkpoint(path)
    except HydraCheckpointError as exc:
        raise DiagError(str(exc)) from None


def model_config_of(ckpt: dict[str, Any]):
    """The model config (HydraConfig or GPTConfig, by the recorded arch) of a hydra-train checkpoint."""
    from hydra_model.architectures import config_from_dict
    from hydra_model.persistence import checkpoint_arch

    cfg = ckpt.get("config", {})
    model_cfg = cfg.get("model", cfg) if isinstance(cfg, dict) else None
    try:
        return config_from_dict(checkpoint_arch(cfg), dict(model_cfg))
    except (TypeError, ValueError) as exc:
        raise DiagError(f"the checkpoint's model config cannot be read: {exc}") from None


def load_model(path: str | Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model of a checkpoint file, save_pretrained folder or run folder, on ``device``."""
    from hydra_model.architectures import arch_of, model_class
    from hydra_model.persistence import load_pretrained, strip_wrapper_prefixes

    p = resolve_checkpoint(path)
    if p.is_dir():
        try:  # the class the folder records (HYDRA when it names none)
            model = load_pretrained(None, p, map_location=device)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            raise DiagError(f"could not load {p}: {exc}") from None
        return LoadedModel(model, f"save_pretrained folder {p}", checkpoint_path=p)
    ckpt = read_checkpoint(p)
    config = model_config_of(ckpt)
    model = model_class(arch_of(config))(config)
    try:
        model.load_state_dict(strip_wrapper_prefixes(ckpt["model"]), strict=True)
    except RuntimeError as exc:
        raise DiagError(f"{p}: weights do not fit the stored config: {str(exc)[:300]}") from None
    train_cfg = ckpt.get("config", {}).get("train", {}) or {}
    step = int(ckpt.get("step", 0))
    return LoadedModel(model.to(device), f"checkpoint {p} (step {step})", step, dict(train_cfg), p)


def require_hydra(model: Any, tool: str) -> None:
    """DiagError unless ``model`` is a HYDRA model: ``tool`` reads its routed blocks, routers or
    experts, which the dense GPT baseline (also loadable here) does not have."""
    from hydra_model.architectures import arch_of

    if arch_of(model) != "hydra":
        raise DiagError(
            f"{tool} reads HYDRA's routed blocks, routers and experts; this is a dense GPT model "
            "(arch gpt), which has none"
        )


def model_from_options(
    model_size: str,
    overrides: list[str] | dict[str, Any] | None,
    checkpoint: str | None,
    device: torch.device,
) -> LoadedModel:
    """``--checkpoint`` when given (``--set`` is then refused), else a fresh ``--model_size``."""
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    if checkpoint:
        if ov:
            raise DiagUsageError("--set changes a fresh model's config; it cannot apply to --checkpoint")
        return load_model(checkpoint, device)
    model = build_model(model_size, ov, device)
    desc = f"fresh {model_size} preset" + (f" with {ov}" if ov else "")
    return LoadedModel(model, desc)


def model_under_test(
    model: Any,
    model_size: str,
    overrides: list[str] | dict[str, Any] | None,
    checkpoint: str | None,
    device: torch.device,
) -> LoadedModel:
    """``model`` moved to ``device`` when a caller passes the object itself (tests plant faults this
    way), else what the options name (:func:`model_from_options`)."""
    if model is None:
        return model_from_options(model_size, overrides, checkpoint, device)
    return LoadedModel(model.to(device), "model object")


# --- data ------------------------------------------------------------------------------------


def random_batches(
    vocab: int, batch_size: int, seq_len: int, n: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uniform random tokens as (input_ids, targets) pairs: enough for shape and health checks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def dataset_batches(
    dataset: str,
    *,
    vocab: int,
    batch_size: int,
    seq_len: int,
    n: int,
    device: torch.device,
    split: str = "val",
    tokenizer: str | None = None,
    seed: int = 0,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """``n`` batches of ``split`` (val: the fixed first windows, as hydra-train evaluates; train:
    hydra-train's shuffled order). ``dataset="synthetic"`` writes a bigram stream to a temp folder."""
    from hydra_train.data_sources import load_data
    from hydra_train.dataset import BatchPlan, eval_batches
    from hydra_train.errors import HydraTrainError

    tmp = None
    if dataset == "synthetic":
        from hydra_diag.synthetic import write_bigram_dataset

        tmp = tempfile.TemporaryDirectory(prefix="hydra_diag_data_")
        need = max(4000, (n * batch_size + 2) * (seq_len + 1) * 2)
        dataset = str(write_bigram_dataset(Path(tmp.name), vocab, need, max(2000, need // 4), seed=seed))
    try:
        data = load_data(
            dataset,
            seq_len=seq_len,
            vocab_size=vocab,
            default_vocab=vocab,
            tokenizer=tokenizer,
            log=lambda m: None,
        )
        if split == "val":
            batches = eval_batches(data.val, batch_size, n)
        else:
            plan = BatchPlan(data.train, batch_size, seed=seed)
            batches = [plan.batch(k) for k in range(n)]
    except HydraTrainError as exc:
        raise DiagError(str(exc)) from None
    finally:
        if tmp is not None:
            tmp.cleanup()
    desc = data.description if tmp is None else f"synthetic bigram stream (vocab {vocab})"
    return [(x.to(device), y.to(device)) for x, y in batches], desc


def batches_for(
    model,
    *,
    dataset: str | None,
    train_config: dict[str, Any] | None,
    batch_size: int,
    seq_len: int,
    n: int,
    device: torch.device,
    seed: int = 0,
    split: str = "val",
    tokenizer: str | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Batches for ``model``: ``--dataset``, else the checkpoint's training data when it is still
    there, else random tokens (``dataset="random"`` asks for those explicitly)."""
    vocab = model.config.vocab_size
    if dataset is None and train_config:
        recorded = train_config.get("dataset")
        from hydra_train.config import EMBEDDED_CORPORA

        if recorded and (recorded in EMBEDDED_CORPORA or Path(recorded).exists()):
            dataset = recorded
            tokenizer = tokenizer or train_config.get("tokenizer")
    if dataset in (None, "random"):
        return random_batches(
            vocab, batch_size, seq_len, n, seed, device
        ), f"uniform random tokens (vocab {vocab})"
    return dataset_batches(
        dataset,
        vocab=vocab,
        batch_size=batch_size,
        seq_len=seq_len,
        n=n,
        device=device,
        split=split,
        tokenizer=tokenizer,
        seed=seed,
    )


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA (as hydra-train trains there), nothing on the CPU."""
    import contextlib

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
