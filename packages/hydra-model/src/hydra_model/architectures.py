"""One entry point for every architecture: ``build_model("hydra" | "gpt", size, **overrides)``.

Saved models and checkpoints record their architecture as ``"arch"``; a HYDRA file written before
that key existed has none and still loads as HYDRA (:data:`DEFAULT_ARCH`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hydra_model.config import MODEL_PRESETS, HydraConfig, preset_config
from hydra_model.gpt import GPTModel
from hydra_model.gpt_config import GPT_PRESETS, GPTConfig, gpt_config
from hydra_model.model import CCGQAMoDMoRModel

#: "hydra": CCGQA + MoD/MoR routing (CCGQAMoDMoRModel); "gpt": the dense baseline (GPTModel)
ARCHITECTURES = ("hydra", "gpt")
DEFAULT_ARCH = "hydra"

_CLASSES: dict[str, type[nn.Module]] = {"hydra": CCGQAMoDMoRModel, "gpt": GPTModel}
_CONFIGS: dict[str, type] = {"hydra": HydraConfig, "gpt": GPTConfig}
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {"hydra": MODEL_PRESETS, "gpt": GPT_PRESETS}


def check_arch(arch: str) -> str:
    """``arch`` itself, or ValueError naming the choices."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
    return arch


def model_class(arch: str) -> type[nn.Module]:
    return _CLASSES[check_arch(arch)]


def config_class(arch: str) -> type:
    return _CONFIGS[check_arch(arch)]


def presets(arch: str) -> dict[str, dict[str, Any]]:
    """The size presets of ``arch`` (both architectures have the same names)."""
    return _PRESETS[check_arch(arch)]


def arch_of(model: nn.Module) -> str:
    """The architecture name of a model (or its config) built by :func:`build_model`."""
    for name, cls in _CLASSES.items():
        if isinstance(model, (cls, _CONFIGS[name])):
            return name
    raise TypeError(f"{type(model).__name__} is not one of the architectures {ARCHITECTURES}")


def build_config(arch: str, model_size: str, **overrides: Any) -> HydraConfig | GPTConfig:
    """The validated config of preset ``model_size`` of ``arch`` with ``overrides`` applied."""
    if check_arch(arch) == "gpt":
        return gpt_config(model_size, **overrides)
    return preset_config(model_size, **overrides)


def build_model(arch: str, model_size: str, **overrides: Any) -> nn.Module:
    """A freshly initialised model: ``arch`` in :data:`ARCHITECTURES`, ``model_size`` one of the
    presets (tiny, debug, 100M, 250M, 500M, 1B), ``overrides`` any field of that arch's config
    (e.g. ``build_model("gpt", "100M", attention="ccgqa")``). Unknown names raise ValueError."""
    return model_class(arch)(build_config(arch, model_size, **overrides))


def config_from_dict(arch: str | None, data: dict[str, Any]) -> HydraConfig | GPTConfig:
    """The config of a saved model: ``arch`` None (files from before "arch" existed) means HYDRA."""
    return config_class(arch or DEFAULT_ARCH).from_dict(data)
