"""Launch configurations per GPU generation, with user overrides.

Each op keeps its own table of defaults keyed by generation (``"blackwell"``, ``"hopper"``,
``"ampere"``, ``"default"``) and asks :func:`resolve_launch_config` which entry applies to the
tensors' device. Overrides, from :func:`set_launch_overrides` or the environment, replace single
fields on top of the table, so a user can try ``num_warps=8`` without knowing the rest. Both, and
the Blackwell switch, are fields of :data:`hydra_kernels.options.OPTIONS`.

Environment overrides (all ops): ``HYDRA_TRITON_NUM_WARPS``, ``HYDRA_TRITON_NUM_STAGES``,
``HYDRA_TRITON_BLOCK_ROWS``, ``HYDRA_TRITON_BLOCK_Q``, ``HYDRA_TRITON_BLOCK_KV``, read at import and
by :func:`reload_env` (``controls.reload_env`` calls it).

Resolved configurations are memoised per (op, generation, table): every kernel launch asks, and
re-reading the environment and the device's compute capability each time cost tens of
microseconds of host time per call. Changing overrides, the Blackwell switch or the environment
(through :func:`reload_env`) empties the memo and every cache registered with
:func:`register_dependent_cache` (the ops' launch plans); code that edits a table in place calls
:func:`clear_resolved_cache`.

The Blackwell entry follows the tuning table of the seed documents (BLOCK_Q 128, BLOCK_KV 64,
8 warps, 3 stages); :func:`set_blackwell_tuning` switches it off (then Blackwell uses the op's
``"default"`` entry), which is what SafeOptimizations' ``blackwell_tuning`` toggles.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch

from hydra_kernels.options import OPTIONS


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched. Row-wise ops use ``block_rows`` (rows per program); tiled ops
    (e.g. vocabulary tiles of linear+CE) use ``block_q``/``block_kv`` as their two tile sizes."""

    num_warps: int = 4
    num_stages: int = 2
    block_rows: int = 1
    block_q: int = 64
    block_kv: int = 64


#: The seed documents' "Blackwell tuning" table, as one launch configuration.
BLACKWELL_TUNING = LaunchConfig(num_warps=8, num_stages=3, block_rows=1, block_q=128, block_kv=64)

GENERATIONS = ("blackwell", "hopper", "ampere", "default")

_ENV_FIELDS = {
    "num_warps": "HYDRA_TRITON_NUM_WARPS",
    "num_stages": "HYDRA_TRITON_NUM_STAGES",
    "block_rows": "HYDRA_TRITON_BLOCK_ROWS",
    "block_q": "HYDRA_TRITON_BLOCK_Q",
    "block_kv": "HYDRA_TRITON_BLOCK_KV",
}

# (op, generation, id(table)) -> resolved config; the table itself is kept to pin its id.
_resolved: dict[tuple[str, str, int], tuple[LaunchConfig, Mapping[str, LaunchConfig]]] = {}
_generations: dict[tuple[str, int | None], str] = {}
# Caches derived from resolved configurations (the ops' per-shape launch plans): emptied with it.
_dependent_caches: list[dict] = []


def register_dependent_cache(cache: dict) -> dict:
    """Empty ``cache`` whenever resolved configurations may change; returns it."""
    _dependent_caches.append(cache)
    return cache


def _invalidate() -> None:
    _resolved.clear()
    for cache in _dependent_caches:
        cache.clear()


def gpu_generation(device: torch.device | None = None) -> str:
    """``"blackwell"`` (sm_100/sm_120), ``"hopper"`` (sm_90), ``"ampere"`` (sm_80/86/89),
    ``"default"`` for anything else, including the CPU under the Triton interpreter."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return "default"
    key = (device.type, device.index)
    gen = _generations.get(key)
    if gen is None:
        major, _ = torch.cuda.get_device_capability(device)
        gen = {10: "blackwell", 9: "hopper", 8: "ampere"}.get(min(major, 10), "default")
        _generations[key] = gen
    return gen


def set_blackwell_tuning(enabled: bool) -> None:
    """Use (True, default) or ignore (False) the ``"blackwell"`` entries of the op tables."""
    OPTIONS.blackwell_tuning = bool(enabled)
    _invalidate()


def blackwell_tuning_enabled() -> bool:
    return OPTIONS.blackwell_tuning


def set_launch_overrides(op: str | None = None, **values: int) -> None:
    """Override launch fields for one op (or all ops when ``op`` is None), e.g. ``num_warps=8``."""
    known = {f.name for f in fields(LaunchConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown launch field(s) {sorted(unknown)}; expected some of {sorted(known)}")
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"launch field {name} must be a positive int, got {value!r}")
    OPTIONS.launch_overrides.setdefault(op, {}).update(values)
    _invalidate()


def clear_launch_overrides() -> None:
    OPTIONS.launch_overrides.clear()
    _invalidate()


def clear_resolved_cache() -> None:
    """Forget memoised configurations and the launch plans built on them (after editing a
    launch table, or a per-generation setting such as programs per SM, in place)."""
    _invalidate()


def reload_env() -> None:
    """Re-read the ``HYDRA_TRITON_*`` overrides from the environment (into ``OPTIONS.launch_env``)."""
    try:
        OPTIONS.launch_env, OPTIONS.launch_env_error = _env_overrides(), None
    except ValueError as exc:  # raised at launch (a counted fallback), not at import
        OPTIONS.launch_env, OPTIONS.launch_env_error = {}, exc
    _invalidate()


def _env_overrides() -> dict[str, int]:
    out = {}
    for name, var in _ENV_FIELDS.items():
        raw = os.environ.get(var, "").strip()
        if raw:
            try:
                out[name] = int(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} must be a positive integer") from None
    return out


def resolve_launch_config(
    op: str, device: torch.device, defaults: Mapping[str, LaunchConfig]
) -> LaunchConfig:
    """The op's table entry for ``device``'s generation (falling back to ``"default"``), with the
    environment's and then :func:`set_launch_overrides`' fields applied on top."""
    if OPTIONS.launch_env_error is not None:
        raise OPTIONS.launch_env_error
    gen = gpu_generation(device)
    key = (op, gen, id(defaults))
    hit = _resolved.get(key)
    if hit is not None and hit[1] is defaults:
        return hit[0]
    table_gen = "default" if gen == "blackwell" and not OPTIONS.blackwell_tuning else gen
    cfg = defaults.get(table_gen) or defaults["default"]
    overrides = OPTIONS.launch_overrides
    patch = {**OPTIONS.launch_env, **overrides.get(None, {}), **overrides.get(op, {})}
    cfg = replace(cfg, **patch) if patch else cfg
    _resolved[key] = (cfg, defaults)
    return cfg


reload_env()
