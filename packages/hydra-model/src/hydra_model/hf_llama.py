"""The dense GPT as a native transformers ``LlamaForCausalLM`` and back.

The GPT's maths is Llama's (hydra_model/gpt.py's docstring maps every weight): RMSNorm with
``norm_eps``, rotate-half RoPE over the whole head with base ``rope_base``, SwiGLU without
biases, GQA with query head h reading key/value head h // (n_heads / n_kv_heads), scale
1/√head_dim, tied embeddings. So the export is a config.json of ``model_type`` "llama" and the
weights under Llama's names (the fused ``w_qkv`` / ``w_gate_up`` split by rows); no remote code.
A GPT with ``attention="ccgqa"`` is not a Llama and is refused.

The import takes a Llama folder (config.json + safetensors, one file or shards) and refuses
what the GPT cannot compute exactly: biases, an LM head other than the embedding, a scaled
RoPE, another activation, another model_type. Only json and safetensors are read: no transformers needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hydra_model.gpt_config import GPTConfig

#: GPT state-dict name → Llama name: weights outside the layers, and per layer ``{i}``
_GLOBAL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_PER_LAYER = {
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.w_o.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.w_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")


class NotALlamaError(ValueError):
    """The model or folder cannot be expressed exactly as the other side."""


def check_exportable_gpt(cfg: GPTConfig) -> None:
    if cfg.attention != "gqa":
        raise NotALlamaError(
            f"this GPT uses attention={cfg.attention!r} (HYDRA's CCGQA: convolutions, q-k mean, value "
            "shift, QK norm), which a Llama cannot compute; only attention='gqa' GPTs export to Hugging Face"
        )


def llama_config(cfg: GPTConfig, special_ids: dict[str, int | None], dtype: str) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLM`` computing what the GPT of ``cfg`` computes."""
    check_exportable_gpt(cfg)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # both spellings: transformers 5 reads rope_parameters, 4.x rope_theta
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "dtype": dtype,
        **special_ids,
    }


def gpt_to_llama_state(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The GPT's state dict under Llama names (the tied LM head is not written: Llama ties it)."""
    check_exportable_gpt(cfg)
    out = {theirs: state[ours] for ours, theirs in _GLOBAL.items()}
    for i in range(cfg.n_layers):
        for ours, theirs in _PER_LAYER.items():
            out[theirs.format(i=i)] = state[ours.format(i=i)]
        qkv = state[f"layers.{i}.attn.w_qkv.weight"].split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim])
        for name, part in zip(_QKV, qkv, strict=True):
            out[f"model.layers.{i}.self_attn.{name}.weight"] = part
        gate, up = state[f"layers.{i}.mlp.w_gate_up.weight"].split([cfg.mlp_hidden, cfg.mlp_hidden])
        out[f"model.layers.{i}.mlp.gate_proj.weight"] = gate
        out[f"model.layers.{i}.mlp.up_proj.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


# --- import ------------------------------------------------------------------------------------


def read_llama_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: is {folder} a Hugging Face model folder?")
    return json.loads(file.read_text(encoding="utf-8"))


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise NotALlamaError(
            f"rope type {kind!r} (a scaled RoPE) is not the GPT's plain RoPE; not importable"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def gpt_config_from_llama(hf: dict[str, Any], folder: Path) -> GPTConfig:
    """The GPTConfig computing exactly what the Llama config.json ``hf`` describes, or
    NotALlamaError naming the first thing that does not fit."""
    kind = hf.get("model_type")
    if kind != "llama":
        raise NotALlamaError(
            f"{folder}: model_type {kind!r} is not 'llama'; import-hf takes Llama models only "
            "(the dense GPT's maths)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise NotALlamaError(f"{folder}: {flag}=true; the GPT has no biases")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise NotALlamaError(f"{folder}: hidden_act={act!r}; the GPT's MLP is SwiGLU (silu)")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    try:
        return GPTConfig(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            mlp_hidden=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_base=_rope_theta(hf),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except ValueError as exc:
        raise NotALlamaError(f"{folder}: this Llama does not fit the GPT: {exc}") from None


def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index lists."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(_load_safetensors(folder / shard))
        return state
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise NotALlamaError(
        f"{folder}: no model.safetensors (or model.safetensors.index.json)"
        + (
            f"; found {', '.join(found)}: re-save it with save_pretrained(safe_serialization=True)"
            if found
            else ""
        )
    )


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except SafetensorError as exc:  # not a ValueError: the command line would show a traceback
        raise ValueError(f"{file} is unreadable, probably truncated or corrupt ({exc})") from None


def llama_to_gpt_state(
    state: dict[str, torch.Tensor], cfg: GPTConfig, folder: Path, tied: bool
) -> dict[str, torch.Tensor]:
    """Llama weights under GPT names (q/k/v and gate/up stacked by rows). Refuses biases and an
    LM head that differs from the embedding (``tied``: the config's tie_word_embeddings)."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    biases = sorted(k for k in state if k.endswith(".bias"))
    if biases:
        raise NotALlamaError(f"{folder}: holds biases ({biases[0]}, …); the GPT has none")
    head = state.pop("lm_head.weight", None)
    embed = state.get("model.embed_tokens.weight")
    if head is not None and embed is not None and not torch.equal(head, embed):
        raise NotALlamaError(
            f"{folder}: lm_head.weight differs from the embedding (an untied LM head); the GPT's head is "
            "its embedding matrix, so the head would be lost"
        )
    if head is None and not tied:
        raise NotALlamaError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise NotALlamaError(f"{folder}: weight {name} is missing")
        used.add(name)
        return state[name]

    out = {ours: take(theirs) for ours, theirs in _GLOBAL.items()}
    for i in range(cfg.n_layers):
        for ours, theirs in _PER_LAYER.items():
            out[ours.format(i=i)] = take(theirs.format(i=i))
        parts = [take(f"model.layers.{i}.self_attn.{name}.weight") for name in _QKV]
        out[f"layers.{i}.attn.w_qkv.weight"] = torch.cat(parts, dim=0)
        gate_up = [take(f"model.layers.{i}.mlp.{name}.weight") for name in ("gate_proj", "up_proj")]
        out[f"layers.{i}.mlp.w_gate_up.weight"] = torch.cat(gate_up, dim=0)
    extra = sorted(k for k in set(state) - used if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise NotALlamaError(f"{folder}: weights the GPT has no place for: {', '.join(extra[:3])}")
    return out
