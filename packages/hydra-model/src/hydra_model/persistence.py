"""Saving and loading: a directory (config.json + model.safetensors) or a hydra-train checkpoint
file (a torch.save dict with "model" = state_dict and "config" = the model config's to_dict()).

Both record the architecture as "arch" ("hydra" or "gpt", see hydra_model.architectures); files
written before that key existed hold HYDRA models and load as such. :func:`load_model` and
:func:`load_checkpoint_file` with ``cls=None`` pick the class from the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hydra_model.ccgqa import CCGQAAttention
from hydra_model.config import HydraConfig
from hydra_model.error_text import shortened

if TYPE_CHECKING:
    from hydra_model.gpt_config import GPTConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "hydra-model/1"


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    from safetensors.torch import save_file

    from hydra_model import __version__
    from hydra_model.architectures import arch_of

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "hydra_model_version": __version__,
        "arch": arch_of(model),
        "config": model.config.to_dict(),
    }
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Both files are written under temporary names first and renamed over the old ones only once
    # both are complete: a save that fails part-way (full disk, killed process) into a folder
    # holding an earlier save leaves that save loadable, not a new config beside cut-off weights.
    tmp_weights, tmp_config = out / f".{WEIGHTS_FILE}.tmp", out / f".{CONFIG_FILE}.tmp"
    try:
        save_file(state, str(tmp_weights), metadata={"format": FORMAT})
        tmp_config.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        tmp_weights.replace(out / WEIGHTS_FILE)
        tmp_config.replace(out / CONFIG_FILE)
    finally:
        tmp_weights.unlink(missing_ok=True)
        tmp_config.unlink(missing_ok=True)
    return out


def read_arch(path: str | Path) -> str:
    """The architecture a save_pretrained directory holds ("hydra" when it names none)."""
    from hydra_model.architectures import DEFAULT_ARCH, check_arch

    return check_arch(_read_meta(path).get("arch") or DEFAULT_ARCH)


def _read_meta(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: is {path} a directory written by save_pretrained?")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc}); the save is damaged") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file} holds a JSON {type(meta).__name__}, not save_pretrained's object")
    if "model_type" in meta and "config" not in meta:
        # a transformers config.json (an export-hf folder, a downloaded model): its keys would
        # otherwise be reported one by one as unknown HydraConfig fields
        raise ValueError(
            f"{path} is a Hugging Face model folder (model_type {meta['model_type']!r}), not one "
            "written by save_pretrained: load it with transformers' AutoModelForCausalLM, or "
            "convert a Llama with `hydra-model import-hf`"
        )
    return meta


def read_config(path: str | Path) -> HydraConfig | GPTConfig:
    """The model config stored in a save_pretrained directory (HydraConfig or GPTConfig)."""
    from hydra_model.architectures import config_from_dict

    meta = _read_meta(path)
    return config_from_dict(meta.get("arch"), meta.get("config", meta))


def _check_class(cls: type[nn.Module], arch: str, path: str | Path) -> None:
    from hydra_model.architectures import model_class

    if not issubclass(cls, model_class(arch)):
        raise ValueError(
            f"{path} holds a {arch!r} model, not a {cls.__name__}; load it with "
            "hydra_model.load_model (which picks the class from the file)"
        )


def load_model(path: str | Path, map_location: Any = "cpu", allow_pickle: bool = False) -> nn.Module:
    """Load a save_pretrained directory or a hydra-train checkpoint file as the class it records
    (``allow_pickle``: see :func:`load_checkpoint_file`)."""
    if Path(path).is_dir():
        return load_pretrained(None, path, map_location)
    return load_checkpoint_file(None, path, map_location, allow_pickle=allow_pickle)


def load_pretrained(cls: type[nn.Module] | None, path: str | Path, map_location: Any = "cpu") -> nn.Module:
    """Load a save_pretrained directory; ``cls`` None picks the class the directory records."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from hydra_model.architectures import model_class

    arch = read_arch(path)
    if cls is None:
        cls = model_class(arch)
    _check_class(cls, arch, path)
    config = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found beside {CONFIG_FILE}")
    with torch.device("meta"):
        model = cls(config)
    # clone: tensors read from the file can sit at any offset, and unaligned weights take other
    # (slower, differently rounding) matmul paths than freshly allocated ones
    try:
        loaded = load_file(str(weights), device=str(map_location))
    except SafetensorError as exc:  # not a ValueError: callers would show a traceback
        raise ValueError(
            f"{weights} is unreadable, probably truncated or corrupt ({exc}); save the model again "
            "or use another checkpoint"
        ) from None
    state = {k: v.clone() for k, v in loaded.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return _materialise_buffers(model, torch.device(map_location))


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrappers' key prefixes: torch.compile's ``_orig_mod.``, DDP's ``module.``."""
    out = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "module."):
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def checkpoint_arch(config_entry: dict[str, Any]) -> str:
    """The architecture of a hydra-train checkpoint from its "config" entry: ``config["arch"]``,
    else the training config's ``arch``, else "hydra" (checkpoints from before the key existed)."""
    from hydra_model.architectures import DEFAULT_ARCH, check_arch

    train = config_entry.get("train")
    arch = config_entry.get("arch") or (train.get("arch") if isinstance(train, dict) else None)
    return check_arch(arch or DEFAULT_ARCH)


def load_checkpoint_file(
    cls: type[nn.Module] | None, path: str | Path, map_location: Any = "cpu", allow_pickle: bool = False
) -> nn.Module:
    """Load a hydra-train checkpoint file; ``cls`` None picks the class the file records.
    ``allow_pickle`` permits arbitrary pickled objects (only for files you trust); without it
    only tensors and plain containers are read. A file's ``checksum`` entry (hydra-train's saver
    and import-hf write one) is verified: a mismatch is a ValueError."""
    if not Path(path).is_file():  # else torch.load's error reads as a corrupt file
        raise FileNotFoundError(f"{path} does not exist (expected a checkpoint file or a save folder)")
    try:
        # read on the host whatever the target device: the checksum hashes every tensor there, and
        # a training checkpoint's optimizer moments (twice the weights) never need the device
        blob = torch.load(str(path), map_location="cpu", weights_only=not allow_pickle)
    except Exception as exc:
        head = _not_a_torch_file(path)
        if head is not None:
            # weights_only reports any non-pickle bytes as a refused object: without this, a Git
            # LFS pointer or a saved error page would be sent to --allow-pickle
            raise ValueError(
                f"{path} is not a PyTorch checkpoint (it begins {head!r}): a Git LFS pointer "
                "(run `git lfs pull`) or a download that failed?"
            ) from exc
        if allow_pickle or not _refused_by_weights_only(exc):
            # truncated or corrupt: --allow-pickle would not help, so it is not suggested
            first = shortened(str(exc), 160)  # torch's is four sentences: whole ones kept
            raise ValueError(
                f"{path} is unreadable, probably truncated or corrupt ({type(exc).__name__}: {first}); "
                "copy it again or use another checkpoint"
            ) from exc
        raise ValueError(
            f"{path} holds objects beyond tensors and plain containers ({type(exc).__name__}); "
            "if you trust the file, load it with allow_pickle=True (CLI: --allow-pickle)"
        ) from exc
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        keys = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(
            f"{path} is not a hydra-train checkpoint: expected keys 'model' and 'config', got {keys}"
        )
    verify_checksum(blob, path)
    from hydra_model.architectures import config_from_dict, model_class

    config_dict = dict(blob["config"])
    arch = checkpoint_arch(config_dict)
    if cls is None:
        cls = model_class(arch)
    _check_class(cls, arch, path)
    # hydra-train stores {"model": <config dict>, "train": <TrainConfig dict>, "arch": …}; a bare
    # model config dict (e.g. written by hand) is accepted too.
    if isinstance(config_dict.get("model"), dict):
        config_dict = dict(config_dict["model"])
    config_dict.pop("arch", None)
    config = config_from_dict(arch, config_dict)
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(strip_wrapper_prefixes(blob["model"]), strict=True, assign=True)
    device = torch.device(map_location)
    if device.type != "cpu":
        # the weights alone go (the blob, optimizer state and all, stays on the host); the buffers
        # still on meta are made on the device next (Module.to would fail on them; _apply, which
        # .to uses, moves tied weights once and leaves a meta tensor as it is here)
        model._apply(lambda t: t if t.is_meta else t.to(device))
    return _materialise_buffers(model, device)


def verify_checksum(blob: dict[str, Any], path: str | Path) -> None:
    """Refuse a checkpoint whose tensors no longer hash to the checksum it was saved with
    (checkpoint_digest.py), as hydra-train's resume does: torch.load reads changed bytes without
    complaint, and the model would generate or export from them. A file without a checksum
    (written by hand, or by an older hydra-train) has nothing to check against and loads."""
    from hydra_model.checkpoint_digest import CHECKSUM_KEY, payload_digest

    saved = blob.get(CHECKSUM_KEY)
    if saved is not None and saved != payload_digest(blob):
        raise ValueError(
            f"checksum mismatch in {path} (the file's bytes changed after it was written); "
            "copy it again or use another checkpoint"
        )


def _not_a_torch_file(path: str | Path) -> bytes | None:
    """The first bytes of ``path`` when they begin neither torch.save's zip archive ("PK") nor a
    pickle (protocol ≥ 2, the legacy format), else None."""
    with open(path, "rb") as f:
        head = f.read(40)
    return None if not head or head.startswith((b"PK", b"\x80")) else head


def _refused_by_weights_only(exc: BaseException) -> bool:
    """True when ``torch.load(weights_only=True)`` read the file but refused an object in it (the
    only case where loading with pickle allowed could succeed)."""
    import pickle

    return isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower()


def check_finite_weights(model: nn.Module, path: str | Path) -> None:
    """Raise ValueError naming the first parameter or buffer holding NaN or inf: such a model (from a
    run that diverged) generates garbage, so callers refuse it instead."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    bad = [n for n, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"{path} holds non-finite weights (NaN/inf in {bad[0]} and {len(bad) - 1} more tensors): "
            "the run that wrote it diverged; use an earlier checkpoint"
        )


def _materialise_buffers(model: nn.Module, device: torch.device) -> nn.Module:
    """Non-persistent buffers (rotary table, statistics) were created on meta: rebuild them."""
    for mod in model.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    if model.rope is not None:
        model.rope._build(model.rope.max_seq_len)
    for mod in model.modules():
        if isinstance(mod, CCGQAAttention):
            mod.rebuild_constants()
    return model
