"""HydraConfig: every knob of the model, the size presets, validation and derived widths."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from hydra_model.config_checks import INT_TYPES
from hydra_model.presets import (  # re-exported: hydra_model.config is where callers import them
    HYDRA_V1_100M,
    HYDRA_V2_100M,
    MODEL_PRESETS,
    PRE_RACE_PRESETS,
    SEED_PARAM_COUNTS,
)

__all__ = [
    "HYDRA_V1_100M",
    "HYDRA_V2_100M",
    "MODEL_PRESETS",
    "MOE_BALANCINGS",
    "MOR_ROUTINGS",
    "PRE_RACE_PRESETS",
    "ROUTINGS",
    "SEED_PARAM_COUNTS",
    "HydraConfig",
    "config_from",
    "preset_config",
    "upgrade_legacy_config",
]

#: how MoR assigns depth: "expert_choice" selects each recursion's tokens by ``routing``'s rule;
#: "token_choice" picks every token's depth up front (routing_rules.py, TokenChoiceRouting)
MOR_ROUTINGS = ("expert_choice", "token_choice")
#: How MoD and MoR (expert choice) pick tokens: a token-selection rule registered in
#: routing_rules.py. ``causal``: a token goes through when its router score clears a tracked
#: threshold and the routing point's causal budget is not spent (the same rule in training,
#: evaluation and decoding; routing_causal.py). ``expert_choice``: the original top-k over the whole
#: sequence in training and a threshold at evaluation (not causal in training; kept as a named
#: ablation). Rules registered later are accepted too (see HydraConfig.validate).
ROUTINGS = ("causal", "expert_choice")
MOE_BALANCINGS = ("aux_loss", "loss_free")


@dataclass
class HydraConfig:
    """All model settings. Field names follow the seed documents where they had one."""

    vocab_size: int = 32000
    dim: int = 512
    n_mor_blocks: int = 2
    recursions_per_block: int = 2
    #: latent query heads and latent key/value heads (GQA inside the compressed space)
    n_heads: int = 4
    n_kv_heads: int = 2
    #: C₁: the query latent width is dim / compression_factor = n_heads · head_dim
    compression_factor: float = 2.0
    mlp_ratio: float = 4.0
    #: MLP hidden width is mlp_ratio · dim rounded up to a multiple of this (matmul-friendly)
    mlp_multiple_of: int = 64
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    dropout: float = 0.0
    init_std: float = 0.02

    # CCGQA
    conv_kernel_seq: int = 2
    conv_kernel_ch: int = 2
    rope_fraction: float = 0.5
    rope_base: float = 10000.0

    #: token selection rule of MoD and MoR expert choice (see ROUTINGS)
    routing: str = "causal"
    #: causal routing: momentum of the running quantile each routing point tracks as its threshold
    router_threshold_momentum: float = 0.99

    # Mixture-of-Depths
    #: False: no MoD router anywhere (every block sees every token); an ablation
    mod_enabled: bool = True
    mod_capacity: float = 0.75
    #: first and last blocks see every token (MoD off there)
    mod_dense_first_last: bool = True
    #: MoD routes every ``mod_block_stride``-th block: those with index % stride == stride − 1
    #: (2: blocks 1, 3, 5, …, the MoD paper's "every other block"); 1 routes them all
    mod_block_stride: int = 1
    mod_aux_weight: float = 0.01

    # Mixture-of-Recursions
    #: False: no MoR router (every token takes every recursion); an ablation. With
    #: recursions_per_block == 1 there is no MoR router either (see ``mor_routed``)
    mor_enabled: bool = True
    mor_routing: str = "expert_choice"
    #: capacities per recursion; None means the linear schedule (R − r) / R
    mor_capacities: tuple[float, ...] | None = None
    mor_gate_alpha: float = 1.0
    mor_aux_weight: float = 0.01
    router_z_weight: float = 1e-3
    ponder_weight: float = 0.0
    mor_balance_weight: float = 0.01

    # Mixture-of-Experts
    moe_enabled: bool = False
    moe_num_experts: int = 4
    moe_top_k: int = 1
    #: expert hidden width; None means the dense MLP's width
    moe_expert_hidden: int | None = None
    moe_balancing: str = "aux_loss"
    moe_aux_weight: float = 0.01
    moe_bias_update_rate: float = 1e-3

    # modes
    static_routing_mode: bool = False
    #: the routing-off ablation (formerly ``dense_baseline``): the same recursive blocks with no
    #: routers and plain GQA attention. Not the dense baseline HYDRA races: that is hydra_model.gpt.
    routing_off: bool = False
    use_chunked_ce: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy integers (e.g. a vocabulary size read from data) → int,
            value = getattr(self, f.name)  # so that to_dict (save_pretrained's config.json) is JSON
            if f.type in INT_TYPES and isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, f.name, int(value))
        if self.mor_capacities is not None:
            self.mor_capacities = tuple(float(c) for c in self.mor_capacities)
        self.validate()

    # --- derived widths --------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Latent head size d = dim / (compression_factor · n_heads)."""
        return round(self.dim / (self.compression_factor * self.n_heads))

    @property
    def q_latent_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_latent_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Channels of each latent head that RoPE rotates (even, at least 2 when fraction > 0)."""
        if self.rope_fraction <= 0:
            return 0
        return max(2, int(self.head_dim * self.rope_fraction) // 2 * 2)

    @property
    def mlp_hidden(self) -> int:
        m = self.mlp_multiple_of
        return int(math.ceil(self.mlp_ratio * self.dim / m) * m)

    @property
    def expert_hidden(self) -> int:
        return self.moe_expert_hidden or self.mlp_hidden

    @property
    def mor_capacity_schedule(self) -> tuple[float, ...]:
        if self.mor_capacities is not None:
            return self.mor_capacities
        r_total = self.recursions_per_block
        return tuple((r_total - r) / r_total for r in range(r_total))

    @property
    def effective_depth(self) -> int:
        """Block applications a token would pass through with every router saying yes."""
        return self.n_mor_blocks * self.recursions_per_block

    @property
    def mor_routed(self) -> bool:
        """Whether MoR blocks have a router: MoR on, routing not off, and more than one
        recursion (with one there is nothing to decide: every token takes the block once, as a
        plain residual update)."""
        return self.mor_enabled and not self.routing_off and self.recursions_per_block > 1

    def mod_routed(self, block_index: int) -> bool:
        """Whether block ``block_index`` routes tokens with MoD (Python-level, fixed per config)."""
        if self.routing_off or not self.mod_enabled:
            return False
        if block_index % self.mod_block_stride != self.mod_block_stride - 1:
            return False
        return not (self.mod_dense_first_last and block_index in (0, self.n_mor_blocks - 1))

    # --- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field and what would fix it
        (config_checks.py)."""
        from hydra_model.config_checks import check_hydra_config

        check_hydra_config(self)

    # --- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples become lists)."""
        out = dataclasses.asdict(self)
        if out["mor_capacities"] is not None:
            out["mor_capacities"] = list(out["mor_capacities"])
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HydraConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError naming them. A whole config
        saved before causal routing existed (it has ``dense_baseline`` and no ``routing``) loads
        as what it was trained with: ``routing="expert_choice"``, ``routing_off`` from
        ``dense_baseline``."""
        d = upgrade_legacy_config(d)
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown HydraConfig field(s) {unknown}; valid fields: {', '.join(cls.field_names())}"
            )
        return cls(**d)

    def diff(self, other: HydraConfig) -> list[str]:
        """Fields that differ, as ``"field: mine != theirs"`` (empty when the configs agree)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k]]

    def replace(self, **changes: Any) -> HydraConfig:
        return config_from(self.to_dict(), **changes)


_LEGACY_FULL_DICT = {"dense_baseline", "mor_routing", "static_routing_mode"}


def upgrade_legacy_config(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict in today's field names (see :meth:`HydraConfig.from_dict`)."""
    if "dense_baseline" not in d:
        return d
    out = dict(d)
    dense = bool(out.pop("dense_baseline"))
    out["routing_off"] = bool(out.get("routing_off", False)) or dense
    if set(d) >= _LEGACY_FULL_DICT and "routing" not in d:
        out["routing"] = "expert_choice"
    return out


def config_from(base: dict[str, Any], **overrides: Any) -> HydraConfig:
    """A validated config from ``base`` updated by ``overrides`` (unknown names raise ValueError)."""
    merged = {**base, **overrides}
    return HydraConfig.from_dict(merged)


def preset_config(model_size: str = "debug", **overrides: Any) -> HydraConfig:
    """The preset ``model_size`` with ``overrides`` applied."""
    if model_size not in MODEL_PRESETS:
        raise ValueError(f"unknown model_size {model_size!r}; presets: {', '.join(MODEL_PRESETS)}")
    return config_from(MODEL_PRESETS[model_size], **overrides)
