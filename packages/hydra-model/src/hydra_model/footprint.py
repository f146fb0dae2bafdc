"""Analytic accounting: FLOPs per token (executed under routing, or dense) and training memory.

FLOPs count multiply-adds as 2; training = forward + backward ≈ 3 × forward. Attention is
causal, so a query at position t over an m-token (sub-)sequence sees (m+1)/2 keys on average.
Routing executes a block application on a fraction of the tokens, and that application's
attention runs over the routed sub-sequence only (its length is the context).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hydra_model.config import HydraConfig
from hydra_model.gpt_config import GPTConfig

if TYPE_CHECKING:
    from hydra_model.gpt import GPTModel
    from hydra_model.model import CCGQAMoDMoRModel


@dataclass
class Application:
    """One (block, recursion) application: share of the sequence's tokens it runs on, and the
    length of the (sub-)sequence its attention sees."""

    block: int
    recursion: int
    token_fraction: float
    context: int


def check_seq_len(seq_len: int) -> None:
    """Raise ValueError unless ``seq_len`` is a positive integer (every count here is per token of
    a ``seq_len``-token sequence: 0 divided by zero deep in :func:`applications`)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")


def attention_widths(cfg: HydraConfig) -> tuple[int, int, int]:
    """(query heads, kv heads, head size) of the attention the config builds."""
    if cfg.routing_off:
        n_q = cfg.dim // cfg.head_dim
        return n_q, n_q * cfg.n_kv_heads // cfg.n_heads, cfg.head_dim
    return cfg.n_heads, cfg.n_kv_heads, cfg.head_dim


def attention_forward_flops(
    e: int, n_q: int, n_kv: int, d: int, context: int, convs: tuple[int, int] | None = None
) -> dict[str, float]:
    """Forward FLOPs per token of one attention layer (model width ``e``, ``n_q``/``n_kv`` heads
    of size ``d``) whose causal attention sees ``context`` tokens; ``convs`` = CCGQA's
    (k_seq, k_ch) conv kernels, None for plain GQA. Both project q, k, v (CCGQA's two value
    halves add up to one v) and the output."""
    q, kv = n_q * d, n_kv * d
    out = {"attn_proj": 2.0 * e * (q + 2 * kv) + 2.0 * q * e}
    if convs is not None:
        c = q + kv
        out["attn_conv"] = 2.0 * c * convs[0] + 2.0 * c * d * convs[1]
    out["attn_core"] = 2.0 * 2.0 * q * (context + 1) / 2.0  # QKᵀ and PV
    return out


def block_forward_flops(cfg: HydraConfig, context: int) -> dict[str, float]:
    """Forward FLOPs per token of one block application whose attention sees ``context`` tokens."""
    e = cfg.dim
    n_q, n_kv, d = attention_widths(cfg)
    convs = None if cfg.routing_off else (cfg.conv_kernel_seq, cfg.conv_kernel_ch)
    out = attention_forward_flops(e, n_q, n_kv, d, context, convs)
    if cfg.moe_enabled:
        out["ffn"] = 2.0 * e * cfg.moe_num_experts + cfg.moe_top_k * 2.0 * 3 * e * cfg.expert_hidden
    else:
        out["ffn"] = 2.0 * 3 * e * cfg.mlp_hidden
    return out


def applications(cfg: HydraConfig, seq_len: int, executed: bool = True) -> list[Application]:
    """Every block application with the share of tokens it executes in a training step (the
    gathered rows, unused ones included: a fixed-shape gather computes them)."""
    from hydra_model.causal_routing import budget_count, capacity_fixed

    apps = []
    r_total = cfg.recursions_per_block
    fixed_shape_dense = cfg.static_routing_mode or not cfg.mor_routed or cfg.mor_routing == "token_choice"
    causal = cfg.routing == "causal"
    for i in range(cfg.n_mor_blocks):
        n = seq_len
        parent = 1.0
        if executed and cfg.mod_routed(i) and not cfg.static_routing_mode and cfg.mod_capacity < 1.0:
            n = math.ceil(cfg.mod_capacity * seq_len)
            parent = cfg.mod_capacity
        for r in range(r_total):
            cap = 1.0 if (not executed or fixed_shape_dense) else cfg.mor_capacity_schedule[r]
            if cap >= 1.0:
                m = n
            elif causal:  # the budget is relative to the whole sequence (causal_routing.py)
                m = min(n, budget_count(capacity_fixed(parent * cap), seq_len))
            else:
                m = math.ceil(cap * n)
            apps.append(Application(i, r, m / seq_len, m))
    return apps


def gpt_flops_breakdown(cfg: GPTConfig, seq_len: int) -> list[dict[str, Any]]:
    """Rows of training FLOPs per token of the dense GPT: one per layer, then the LM head."""
    convs = (2, 2) if cfg.attention == "ccgqa" else None  # CCGQAAttention's default kernels
    rows: list[dict[str, Any]] = []
    for i in range(cfg.n_layers):
        parts = attention_forward_flops(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq_len, convs)
        parts["ffn"] = 2.0 * 3 * cfg.dim * cfg.mlp_hidden
        rows.append(
            {
                "name": f"layer{i}",
                "token_fraction": 1.0,
                "context": seq_len,
                "flops": 3.0 * sum(parts.values()),
            }
        )
    rows.append(
        {
            "name": "lm_head",
            "token_fraction": 1.0,
            "context": seq_len,
            "flops": 3.0 * 2.0 * cfg.dim * cfg.vocab_size,
        }
    )
    return rows


def flops_breakdown(
    cfg: HydraConfig | GPTConfig, seq_len: int, executed: bool = True
) -> list[dict[str, Any]]:
    """Rows of training FLOPs per token: one per block application, routers, LM head (a
    GPTConfig: one per layer and the LM head, the same executed or not)."""
    check_seq_len(seq_len)
    if isinstance(cfg, GPTConfig):
        return gpt_flops_breakdown(cfg, seq_len)
    rows: list[dict[str, Any]] = []
    for app in applications(cfg, seq_len, executed):
        parts = block_forward_flops(cfg, app.context)
        rows.append(
            {
                "name": f"block{app.block}.rec{app.recursion}",
                "token_fraction": app.token_fraction,
                "context": app.context,
                "flops": 3.0 * app.token_fraction * sum(parts.values()),
            }
        )
    e = cfg.dim
    router = 0.0
    if not cfg.routing_off:
        for i in range(cfg.n_mor_blocks):
            router += 2.0 * e * (1 if cfg.mod_routed(i) else 0)
            router += 2.0 * e * cfg.recursions_per_block * (1 if cfg.mor_routed else 0)
    rows.append({"name": "routers", "token_fraction": 1.0, "context": seq_len, "flops": 3.0 * router})
    rows.append(
        {
            "name": "lm_head",
            "token_fraction": 1.0,
            "context": seq_len,
            "flops": 3.0 * 2.0 * e * cfg.vocab_size,
        }
    )
    return rows


def flops_per_token(cfg: HydraConfig | GPTConfig, seq_len: int, executed: bool = True) -> float:
    """Training FLOPs per token (see :func:`flops_breakdown`)."""
    return float(sum(row["flops"] for row in flops_breakdown(cfg, seq_len, executed)))


def _activation_elements_per_token(cfg: HydraConfig | GPTConfig) -> float:
    """Elements one block application (a GPT layer) keeps for the backward per token it processes."""
    e = cfg.dim
    if isinstance(cfg, GPTConfig):
        n_q, n_kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        hidden, moe, routing = cfg.mlp_hidden, False, 0  # nothing gathered or scattered
    else:
        n_q, n_kv, d = attention_widths(cfg)
        hidden = cfg.moe_top_k * cfg.expert_hidden if cfg.moe_enabled else cfg.mlp_hidden
        moe = cfg.moe_enabled
        routing = 2 * e  # gathered input and scattered output copies of the residual
    q, kv = n_q * d, n_kv * d
    attn = 2 * e + (q + 2 * kv) + 4 * (q + kv) + kv + q + e  # norm in/out, proj, convs & norms, v, out
    # norm in/out, gate+up, down out; the dense MLP recomputes its SwiGLU output in the backward
    # (layers._SwiGLUDown), MoE experts keep theirs
    ffn = 2 * e + 2 * hidden + (hidden if moe else 0) + e
    return float(attn + ffn + routing)


def compute_memory_footprint(
    model: CCGQAMoDMoRModel | GPTModel | HydraConfig | GPTConfig,
    batch_size: int,
    seq_len: int,
    activation_bytes: int = 2,
    optimizer_bytes_per_param: int = 8,
) -> dict[str, float]:
    """Estimated training memory (MB) with fp32 weights and grads, AdamW states
    (``optimizer_bytes_per_param``: 8 for fp32 AdamW, 2 for 8-bit) and bf16 activations
    (``activation_bytes``). Routed applications hold activations only for their tokens;
    gradient checkpointing keeps only the inputs of the checkpointed blocks, and the backward
    recomputes one of them at a time (a GPT layer counts as a block)."""
    from hydra_model.gpt import GPTModel
    from hydra_model.model import CCGQAMoDMoRModel

    check_seq_len(seq_len)
    if isinstance(model, (CCGQAMoDMoRModel, GPTModel)):
        cfg, every, n_params = model.config, model._checkpoint_every, model.num_parameters()
    else:
        cfg, every = model, 0
        with torch.device("meta"):  # count without allocating
            cls = GPTModel if isinstance(cfg, GPTConfig) else CCGQAMoDMoRModel
            n_params = cls(cfg).num_parameters()
    mb = 1024.0**2
    tokens = batch_size * seq_len
    per_app = _activation_elements_per_token(cfg) * activation_bytes
    per_block: dict[int, float] = {}
    if isinstance(cfg, GPTConfig):
        per_block = {i: tokens * per_app for i in range(cfg.n_layers)}
    else:
        for app in applications(cfg, seq_len, executed=True):
            per_block[app.block] = per_block.get(app.block, 0.0) + tokens * app.token_fraction * per_app
    if every:
        # a checkpointed block keeps its fp32 input; the backward recomputes one such block at a
        # time, when the blocks after it have freed theirs: the peak is the larger of what the
        # forward keeps and, for each checkpointed block, what the blocks before it keep plus
        # its recomputed activations
        order = sorted(per_block)
        kept = {i: tokens * cfg.dim * 4 if i % every == 0 else per_block[i] for i in order}
        activations, below = sum(kept.values()), 0.0
        for i in order:
            if i % every == 0:
                activations = max(activations, below + per_block[i])
            below += kept[i]
    else:
        activations = sum(per_block.values())
    logits = 0.0 if cfg.use_chunked_ce else tokens * cfg.vocab_size * (activation_bytes + 4 + 4)
    out = {
        "parameters": float(n_params),
        "parameter_mb": n_params * 4 / mb,
        "gradient_mb": n_params * 4 / mb,
        "optimizer_mb": n_params * optimizer_bytes_per_param / mb,
        "activation_mb": activations / mb,
        "logits_mb": logits / mb,
        "batch_size": float(batch_size),
        "seq_len": float(seq_len),
    }
    out["estimated_training_mb"] = sum(
        out[k] for k in ("parameter_mb", "gradient_mb", "optimizer_mb", "activation_mb", "logits_mb")
    )
    return out
