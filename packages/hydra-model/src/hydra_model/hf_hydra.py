"""A HYDRA model as a Hugging Face remote-code model: its layout, its config.json, its code.

The export folder carries ``configuration_hydra.py`` and ``modeling_hydra.py`` (from
``hydra_model/hf_remote/``, copied as they are): a standalone PyTorch implementation of HYDRA's
inference forward that imports only torch and transformers, so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works where HYDRA is not
installed. The weights are HYDRA's state dict under its own names.

What that code builds comes from the ``layout`` written here, read off the model *instance*
(which routers exist, how each routing point decides in ``eval()``, fixed-point capacities,
widths), not re-derived from the HydraConfig rules: if hydra_model changes a rule (say, a block of
one recursion without a router), the layout follows the instance. A module this exporter does
not recognise raises instead of exporting something that would compute differently;
tests/hydra_model/test_hf_export_hydra.py compares the loaded model with hydra_model's own
forward and generation on several configurations.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from hydra_model.blocks import CCGQABlock, CCGQAMoDBlockWrapper, CCGQAMoRBlock
from hydra_model.causal_routing import CAPACITY_BITS, CausalRouter
from hydra_model.ccgqa import CCGQAAttention
from hydra_model.gqa import GQAAttention
from hydra_model.layers import SwiGLUMLP
from hydra_model.model import CCGQAMoDMoRModel
from hydra_model.moe import MoEFFN

#: the shipped remote-code files, copied into every HYDRA export
REMOTE_CODE_DIR = Path(__file__).parent / "hf_remote"
REMOTE_CODE_FILES = ("configuration_hydra.py", "modeling_hydra.py")
MODEL_TYPE = "hydra_ccgqa"
LAYOUT_FORMAT = 1


class UnsupportedModelError(ValueError):
    """The model holds something the exported remote code does not implement."""


def _attention_spec(attn: nn.Module) -> dict[str, Any]:
    common = {
        "n_heads": attn.n_heads,
        "n_kv_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "rotary_dim": attn.rotary_dim,
    }
    if isinstance(attn, CCGQAAttention):
        return {"kind": "ccgqa", **common, "conv_kernel_seq": attn.k_seq, "conv_kernel_ch": attn.k_ch}
    if isinstance(attn, GQAAttention):
        return {"kind": "gqa", **common}
    raise UnsupportedModelError(f"attention {type(attn).__name__} has no exported implementation")


def _ffn_spec(ffn: nn.Module) -> dict[str, Any]:
    if isinstance(ffn, MoEFFN):
        return {
            "kind": "moe",
            "hidden": ffn.hidden,
            "n_experts": ffn.n_experts,
            "top_k": ffn.top_k,
            "balancing": ffn.balancing,
        }
    if isinstance(ffn, SwiGLUMLP):
        return {"kind": "swiglu", "hidden": ffn.hidden}
    raise UnsupportedModelError(f"FFN {type(ffn).__name__} has no exported implementation")


def _block_spec(block: CCGQABlock) -> dict[str, Any]:
    if block.norm1.eps != block.norm2.eps:
        raise UnsupportedModelError("a block whose two norms have different epsilons")
    return {
        "norm_eps": block.norm1.eps,
        "attention": _attention_spec(block.attn),
        "ffn": _ffn_spec(block.ffn),
    }


#: MoR modes whose inference forward needs a router of one logit per recursion (or per depth)
_ROUTED_MOR = ("static", "token_choice", "causal", "expert_choice")


def _mor_spec(mor: CCGQAMoRBlock) -> dict[str, Any]:
    mode = mor.mode
    if mode not in ("dense", *_ROUTED_MOR):
        raise UnsupportedModelError(f"MoR mode {mode!r} has no exported implementation")
    has_router = getattr(mor, "router", None) is not None
    if mode in _ROUTED_MOR and not has_router and mor.recursions == 1:
        mode = "dense"  # one recursion without a router: the plain residual update h + block(h)
    if (mode in _ROUTED_MOR) != has_router:
        raise UnsupportedModelError(f"MoR mode {mode!r} with{'' if has_router else 'out'} a router")
    causal = getattr(mor, "causal", None) or {}
    if mode == "static":
        causal = {}  # kept for a switch back to dynamic routing; static routing never reads them
    elif causal and mode != "causal":
        raise UnsupportedModelError(f"causal routing points in a MoR block of mode {mode!r}")
    spec: dict[str, Any] = {
        "kind": mode,
        "recursions": mor.recursions,
        "alpha": float(mor.alpha),
        "router": has_router,
        "causal_cap_q": {str(r): _cap_q(router) for r, router in causal.items()},
        "block": _block_spec(mor.block),
    }
    if mode == "expert_choice":
        spec["capacities"] = [float(c) for c in mor.capacities]
    return spec


def _cap_q(router: nn.Module) -> int:
    if not isinstance(router, CausalRouter):
        raise UnsupportedModelError(f"routing point {type(router).__name__} has no exported implementation")
    return int(router.cap_q)


def _mod_spec(wrapper: CCGQAMoDBlockWrapper) -> dict[str, Any]:
    """How the MoD wrapper decides in eval(): none (no router), causal (threshold + budget),
    soft (every token, mixed by σ(logit): static routing or capacity 1), threshold (σ > ½)."""
    if not wrapper.routed:
        return {"kind": "none"}
    if wrapper.router is None:
        raise UnsupportedModelError("a routed MoD block without a router")
    if wrapper.static or wrapper.capacity >= 1.0:
        return {"kind": "soft"}
    if wrapper.rule == "causal" and wrapper.causal is not None:
        return {"kind": "causal", "cap_q": _cap_q(wrapper.causal)}
    if wrapper.rule == "expert_choice":
        return {"kind": "threshold"}
    raise UnsupportedModelError(f"MoD routing rule {wrapper.rule!r} has no exported implementation")


def hydra_export_state(model: CCGQAMoDMoRModel) -> dict[str, Any]:
    """The weights the shipped code reads: the state dict without the causal thresholds that a
    block in static mode keeps only for a switch back to dynamic routing, and without the MoE
    layers' ``pending_load`` (training state: the next training step's bias update)."""
    unused: list[str] = []
    for i, wrapper in enumerate(model.blocks):
        if wrapper.static:
            unused.append(f"blocks.{i}.causal.")
        if wrapper.mor.mode == "static":
            unused.append(f"blocks.{i}.mor.causal.")
    state = model.state_dict()
    return {
        k: v for k, v in state.items() if not k.startswith(tuple(unused)) and not k.endswith(".pending_load")
    }


def hydra_layout(model: CCGQAMoDMoRModel) -> dict[str, Any]:
    """What every block of ``model`` computes at inference, for modeling_hydra.py (JSON-able)."""
    blocks = []
    for wrapper in model.blocks:
        if not isinstance(wrapper, CCGQAMoDBlockWrapper) or not isinstance(wrapper.mor, CCGQAMoRBlock):
            raise UnsupportedModelError(f"block {type(wrapper).__name__} has no exported implementation")
        blocks.append({"mod": _mod_spec(wrapper), "mor": _mor_spec(wrapper.mor)})
    rope_base = model.rope.base if model.rope is not None else model.config.rope_base
    return {
        "format": LAYOUT_FORMAT,
        "capacity_bits": CAPACITY_BITS,
        "rope_base": float(rope_base),
        "norm_eps": model.norm.eps,
        "blocks": blocks,
    }


def hydra_hf_config(
    model: CCGQAMoDMoRModel, special_ids: dict[str, int | None], dtype: str
) -> dict[str, Any]:
    """config.json of the export: model_type, auto_map to the shipped code, the layout."""
    cfg = model.config
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["HydraForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_hydra.HydraHFConfig",
            "AutoModelForCausalLM": "modeling_hydra.HydraForCausalLM",
        },
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_mor_blocks,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": True,
        "use_cache": False,
        "dtype": dtype,
        **special_ids,
        "layout": hydra_layout(model),
        "hydra": cfg.to_dict(),
    }


def copy_remote_code(out: Path) -> list[Path]:
    """Copy the modeling files into the export folder."""
    written = []
    for name in REMOTE_CODE_FILES:
        target = out / name
        shutil.copyfile(REMOTE_CODE_DIR / name, target)
        written.append(target)
    return written
