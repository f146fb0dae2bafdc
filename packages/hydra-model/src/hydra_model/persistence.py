"""Saving and loading: a directory (config.json + model.safetensors) or a hydra-train checkpoint
file (a torch.save dict with "model" = state_dict and "config" = HydraConfig.to_dict())."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hydra_model.ccgqa import CCGQAAttention
from hydra_model.config import HydraConfig

if TYPE_CHECKING:
    from hydra_model.model import CCGQAMoDMoRModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "hydra-model/1"


def save_pretrained(model: CCGQAMoDMoRModel, path: str | Path) -> Path:
    from safetensors.torch import save_file

    from hydra_model import __version__

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "hydra_model_version": __version__, "config": model.config.to_dict()}
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    return out


def read_config(path: str | Path) -> HydraConfig:
    """The HydraConfig stored in a save_pretrained directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: is {path} a directory written by save_pretrained?")
    meta = json.loads(file.read_text(encoding="utf-8"))
    return HydraConfig.from_dict(meta.get("config", meta))


def load_pretrained(
    cls: type[CCGQAMoDMoRModel], path: str | Path, map_location: Any = "cpu"
) -> CCGQAMoDMoRModel:
    from safetensors.torch import load_file

    config = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found beside {CONFIG_FILE}")
    with torch.device("meta"):
        model = cls(config)
    # clone: tensors read from the file can sit at any offset, and unaligned weights take other
    # (slower, differently rounding) matmul paths than freshly allocated ones
    state = {k: v.clone() for k, v in load_file(str(weights), device=str(map_location)).items()}
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


def load_checkpoint_file(
    cls: type[CCGQAMoDMoRModel], path: str | Path, map_location: Any = "cpu", allow_pickle: bool = False
) -> CCGQAMoDMoRModel:
    """Load a hydra-train checkpoint file. ``allow_pickle`` permits arbitrary pickled objects
    (only for files you trust); without it only tensors and plain containers are read."""
    try:
        blob = torch.load(str(path), map_location=map_location, weights_only=not allow_pickle)
    except Exception as exc:
        if allow_pickle:
            raise
        raise ValueError(
            f"{path} holds objects beyond tensors and plain containers ({type(exc).__name__}); "
            "if you trust the file, load it with allow_pickle=True (CLI: --allow-pickle)"
        ) from exc
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        keys = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(
            f"{path} is not a hydra-train checkpoint: expected keys 'model' and 'config', got {keys}"
        )
    config_dict = dict(blob["config"])
    # hydra-train stores {"model": <HydraConfig dict>, "train": <TrainConfig dict>}; a bare
    # HydraConfig dict (e.g. written by hand) is accepted too.
    if isinstance(config_dict.get("model"), dict):
        config_dict = dict(config_dict["model"])
    config = HydraConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(strip_wrapper_prefixes(blob["model"]), strict=True, assign=True)
    return _materialise_buffers(model, torch.device(map_location))


def _materialise_buffers(model: CCGQAMoDMoRModel, device: torch.device) -> CCGQAMoDMoRModel:
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
