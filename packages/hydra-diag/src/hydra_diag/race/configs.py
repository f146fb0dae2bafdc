"""The race's named configurations, in ONE table, and ``--set CONFIG.FIELD=VALUE`` overrides.

Each entry is (arch, model overrides, what it is). ``arch`` goes to ``hydra_model.build_model``;
the overrides are fields of that arch's config (GPTConfig or HydraConfig). To add or change a
configuration, edit :data:`RACE_CONFIGS`; nothing else names them.

``--set`` items are ``CONFIG.FIELD=VALUE``: CONFIG is a name or a shell-style wildcard over the
names (``*`` every configuration, ``hydra*`` every HYDRA one); VALUE is read as JSON (``true``,
``0.125``, ``"ccgqa"``) else kept as text; a later item wins. Two fields belong to the race rather
than the model: ``lr`` (that configuration's peak learning rate) and ``compile`` (``model``,
``graphs`` = the model compiled and replayed as CUDA graphs, ``blocks`` or ``none``; see
:mod:`hydra_diag.race.loop`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from hydra_diag.output import DiagError, DiagUsageError
from hydra_model.config import HYDRA_V1_100M, HYDRA_V2_100M

#: name -> (arch, model overrides, description)
RACE_CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt": ("gpt", {}, "dense pre-norm GPT, GQA attention (the baseline a user would train)"),
    "gpt-ccgqa": ("gpt", {"attention": "ccgqa"}, "the dense GPT with HYDRA's CCGQA attention"),
    "hydra": ("hydra", {}, "HYDRA: CCGQA + MoD (+ MoR where the preset has recursions)"),
    "hydra-no-mod": ("hydra", {"mod_enabled": False}, "HYDRA without Mixture-of-Depths"),
    "hydra-no-mor": ("hydra", {"mor_enabled": False}, "HYDRA without MoR routing (all recursions)"),
    "hydra-mor": (
        "hydra",
        {"recursions_per_block": 2, "mor_capacities": [1.0, 0.5]},
        "HYDRA with MoR: each block twice, the second time for half the tokens",
    ),
    "hydra-routing-off": ("hydra", {"routing_off": True}, "HYDRA's blocks, no routers, GQA attention"),
    "hydra-expert-choice": ("hydra", {"routing": "expert_choice"}, "HYDRA with top-k expert-choice routing"),
    "hydra-c3": (
        "hydra",
        {**HYDRA_V2_100M, "recursions_per_block": 1, "mor_capacities": None},
        "HYDRA with CCGQA compressed 3x (4 latent query heads), wider MLP, one recursion",
    ),
    "hydra-v2": ("hydra", dict(HYDRA_V2_100M), "HYDRA's 100M preset of the 2026-11-23 race (12 x 2, C=3)"),
    "hydra-v1": ("hydra", dict(HYDRA_V1_100M), "HYDRA's 100M preset before the race (8 x 4, MoD 0.75)"),
}
DEFAULT_CONFIGS = ("gpt", "hydra")
RACE_FIELDS = ("lr", "compile")
COMPILE_CHOICES = ("model", "graphs", "blocks", "none")


@dataclass
class RaceConfig:
    """One resolved entrant: its name, arch, model overrides and race settings."""

    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    lr: float = 6e-4
    compile: str = "model"
    description: str = ""

    @property
    def routed(self) -> bool:
        """Whether training-mode and inference-mode routing differ (a second val column)."""
        if self.arch != "hydra":
            return False
        return not (self.overrides.get("routing_off") or self.overrides.get("dense_baseline"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "arch": self.arch,
            "overrides": dict(self.overrides),
            "lr": self.lr,
            "compile": self.compile,
            "description": self.description,
            "routed": self.routed,
        }


def parse_config_names(spec: str | None) -> list[str]:
    """``"gpt,hydra"`` (or ``all``) → names; an unknown name is a DiagUsageError listing the table."""
    if not spec:
        return list(DEFAULT_CONFIGS)
    names = list(RACE_CONFIGS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in RACE_CONFIGS]
    if unknown or not names:
        choices = ", ".join(RACE_CONFIGS)
        raise DiagUsageError(
            f"--configs: unknown configuration(s) {unknown or spec!r}; choose from all, {choices}"
        )
    if len(set(names)) != len(names):
        raise DiagUsageError(f"--configs {spec!r} names a configuration twice")
    return names


def parse_sets(items: list[str] | None) -> list[tuple[str, dict[str, Any]]]:
    """``["hydra*.compile=blocks", "*.use_chunked_ce=true"]`` → ``[("hydra*", {"compile": "blocks"}),
    ("*", {"use_chunked_ce": True})]``: (pattern, setting) in command-line order. A pattern is a
    configuration name or a shell-style wildcard over the names; one that matches none is an error."""
    from hydra_kernels.cli_support import AssignmentError, parse_assignments

    out: list[tuple[str, dict[str, Any]]] = []
    for item in items or []:
        target, dot, _ = item.partition(".")
        if not dot or "=" not in item or "=" in target:
            raise DiagUsageError(
                f"--set {item!r}: write CONFIG.FIELD=VALUE (e.g. hydra.mod_capacity=0.125) or *.FIELD=VALUE"
            )
        if not fnmatch.filter(RACE_CONFIGS, target):
            raise DiagUsageError(
                f"--set {item!r}: no configuration {target!r}; choose from *, {', '.join(RACE_CONFIGS)} "
                "(wildcards such as hydra* allowed)"
            )
        try:
            out.append((target, parse_assignments([item[len(target) + 1 :]])))
        except AssignmentError:
            raise DiagUsageError(f"--set {item!r}: write CONFIG.FIELD=VALUE") from None
    return out


def resolve_configs(
    names: list[str], sets: list[tuple[str, dict[str, Any]]], *, lr: float, compile_default: str
) -> list[RaceConfig]:
    """The entrants in order: the table's overrides, then every ``--set`` whose pattern matches the
    name, in command-line order (a later one wins)."""
    out = []
    for name in names:
        arch, base, desc = RACE_CONFIGS[name]
        merged = dict(base)
        for pattern, setting in sets:
            if fnmatch.fnmatchcase(name, pattern):
                merged.update(setting)
        cfg = RaceConfig(name, arch, {}, lr=lr, compile=compile_default, description=desc)
        for k, v in merged.items():
            if k == "lr":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                    raise DiagUsageError(
                        f"--set {name}.lr={v!r}: the learning rate must be a positive number"
                    )
                cfg.lr = float(v)
            elif k == "compile":
                if v not in COMPILE_CHOICES:
                    raise DiagUsageError(
                        f"--set {name}.compile={v!r}: choose one of {', '.join(COMPILE_CHOICES)}"
                    )
                cfg.compile = v
            else:
                cfg.overrides[k] = v
        out.append(cfg)
    return out


def check_buildable(
    cfgs: list[RaceConfig], model_size: str, extra: dict[str, Any], *, usage: bool = True
) -> None:
    """Validate every entrant's model config up front (cheap; no weights), so a bad --model-size or
    ``--set`` fails (DiagUsageError: exit 2) before the corpus is read and the first configuration
    spends its budget. ``usage=False`` once the data decided ``extra`` (its vocabulary): a DiagError."""
    from hydra_model.architectures import build_config

    error = DiagUsageError if usage else DiagError
    for c in cfgs:
        try:
            build_config(c.arch, model_size, **{**extra, **c.overrides})
        except (ValueError, TypeError) as exc:
            raise error(f"configuration {c.name} ({c.arch} {model_size}, {c.overrides}): {exc}") from None
