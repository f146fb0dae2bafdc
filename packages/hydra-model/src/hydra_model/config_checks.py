"""HydraConfig's checks (:meth:`hydra_model.config.HydraConfig.validate`): each names the first
inconsistent field and what would fix it, before a model is built from it."""

from __future__ import annotations

import itertools
import numbers
from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hydra_model.config import HydraConfig

#: the annotations (strings: ``from __future__ import annotations``) of the integer fields
INT_TYPES = ("int", "int | None")


def check_hydra_config(cfg: HydraConfig) -> None:
    """Raise ValueError naming the first inconsistent field of ``cfg`` and what would fix it."""
    from hydra_model.config import MOE_BALANCINGS, MOR_ROUTINGS

    def bad(msg: str) -> None:
        raise ValueError(f"HydraConfig: {msg}")

    # types first: a float or bool width reached torch.empty as a TypeError naming no field
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.type in INT_TYPES and (value is not None or f.type == "int"):
            if isinstance(value, bool) or not isinstance(value, int):
                bad(f"{f.name}={value!r} must be an integer")
        elif f.type == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            bad(f"{f.name}={value!r} must be a number")
    for name in (
        "vocab_size",
        "dim",
        "n_mor_blocks",
        "recursions_per_block",
        "n_heads",
        "n_kv_heads",
        "max_seq_len",
        "conv_kernel_seq",
        "conv_kernel_ch",
        "moe_num_experts",
        "mod_block_stride",
        "mlp_multiple_of",
    ):
        if getattr(cfg, name) < 1:
            bad(f"{name}={getattr(cfg, name)} must be a positive integer")
    if cfg.moe_expert_hidden is not None and cfg.moe_expert_hidden < 1:
        bad(f"moe_expert_hidden={cfg.moe_expert_hidden} must be positive (None: the MLP's width)")
    # zero or negative: an empty or negative MLP, NaN norms (rsqrt of a negative), a rotary
    # table of inf/NaN, a crash in the weight init
    for name in ("mlp_ratio", "norm_eps", "rope_base", "init_std"):
        if not getattr(cfg, name) > 0:
            bad(f"{name}={getattr(cfg, name)} must be positive")
    if cfg.compression_factor <= 0:
        bad(f"compression_factor={cfg.compression_factor} must be positive")
    width = cfg.dim / (cfg.compression_factor * cfg.n_heads)
    if abs(width - round(width)) > 1e-6 or round(width) < 2:
        bad(
            f"latent head size dim / (compression_factor · n_heads) = {cfg.dim} / "
            f"({cfg.compression_factor} · {cfg.n_heads}) = {width:g} is not an integer ≥ 2; "
            "pick compression_factor and n_heads so that it divides evenly"
        )
    if cfg.head_dim % 2:
        bad(f"latent head size {cfg.head_dim} must be even (value shift and RoPE split channels)")
    if cfg.n_kv_heads > cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        bad(
            f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads={cfg.n_kv_heads} "
            "(GQA in the latent space needs C₂ ≥ C₁)"
        )
    if cfg.routing_off and (
        cfg.dim % cfg.head_dim or (cfg.dim // cfg.head_dim * cfg.n_kv_heads) % cfg.n_heads
    ):
        bad(
            f"routing_off keeps head size {cfg.head_dim} and the q/kv head ratio {cfg.n_heads}/"
            f"{cfg.n_kv_heads}, so dim={cfg.dim} must give a whole number of heads of each kind"
        )
    if not 0 < cfg.mod_capacity <= 1:
        bad(f"mod_capacity={cfg.mod_capacity} must be in (0, 1]")
    caps = cfg.mor_capacity_schedule
    if len(caps) != cfg.recursions_per_block:
        bad(f"mor_capacities has {len(caps)} entries, recursions_per_block is {cfg.recursions_per_block}")
    if any(not 0 < c <= 1 for c in caps) or any(b > a for a, b in itertools.pairwise(caps)):
        bad(f"mor_capacities={caps} must lie in (0, 1] and not increase (recursion r picks among r−1's)")
    if cfg.routing == "causal" and cfg.mor_routed and cfg.mor_routing == "expert_choice" and caps[0] < 1:
        # the causal rule routes recursions 1.. only (routing_causal.py): the first would
        # take every token whatever this says, and footprint.py would count it at caps[0]
        bad(
            f"mor_capacities[0]={caps[0]}: causal routing sends every token through the first "
            "recursion, so it must be 1.0; lower the later ones or use routing='expert_choice'"
        )
    if cfg.mor_routing not in MOR_ROUTINGS:
        bad(f"mor_routing={cfg.mor_routing!r}; expected one of {MOR_ROUTINGS}")
    from hydra_model.routing_rules import token_selection_rules

    if cfg.routing not in token_selection_rules():
        bad(f"routing={cfg.routing!r}; expected one of {token_selection_rules()}")
    if not 0 <= cfg.router_threshold_momentum < 1:
        bad(f"router_threshold_momentum={cfg.router_threshold_momentum} must be in [0, 1)")
    if cfg.moe_balancing not in MOE_BALANCINGS:
        bad(f"moe_balancing={cfg.moe_balancing!r}; expected one of {MOE_BALANCINGS}")
    if cfg.moe_top_k not in (1, 2) or cfg.moe_top_k > cfg.moe_num_experts:
        bad(f"moe_top_k={cfg.moe_top_k} must be 1 or 2 and ≤ moe_num_experts={cfg.moe_num_experts}")
    if not 0 <= cfg.rope_fraction <= 1:
        bad(f"rope_fraction={cfg.rope_fraction} must be in [0, 1]")
    if cfg.dropout != 0.0:
        bad("dropout must be 0.0 (routing and checkpoint recomputation assume a deterministic block)")
