"""Plain grouped-query attention (no compression, no convs, no q-k mean, no value shift, no QK
norm) with the decoding cache: the attention of HYDRA's ``routing_off`` ablation (partial RoPE)
and of the dense GPT (:mod:`hydra_model.gpt`, RoPE over the whole head).

``w_qkv`` stacks W_q (``n_heads·head_dim`` rows), W_k and W_v (``n_kv_heads·head_dim`` rows each),
head h at rows h·head_dim onwards within each; query head h reads key/value head
h // (n_heads / n_kv_heads). RoPE rotates the first 2·cos.shape[-1] channels of each head in the
rotate-half layout (``hydra_kernels.rope``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from hydra_kernels import rope
from hydra_model.attention_backend import flexible_attention
from hydra_model.cache import CacheSlot, decode_attend, prefill_kv


class GQAAttention(nn.Module):
    """Standard causal GQA on x [B, n, E] → [B, n, E] with head size ``head_dim``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rotary_dim: int) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim, self.rotary_dim = (
            n_heads,
            n_kv_heads,
            head_dim,
            rotary_dim,
        )
        self.q_dim, self.kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        self.w_qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim, bias=False)
        self.w_o = nn.Linear(self.q_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        *,
        slot: CacheSlot | None = None,
        member: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        d = self.head_dim
        entry = slot.entry if slot is not None else None
        if entry is not None:  # a decode step: RoPE, the cache writes and the mask in one kernel
            if n != 1:
                raise ValueError(f"a decode step takes one token per sequence, got x {tuple(x.shape)}")
            proj = self.w_qkv(x)[:, 0]  # [B, q_dim + 2·kv_dim]
            q, k, v = proj.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            rotary = self.rotary_dim > 0
            out = decode_attend(
                entry, q.view(b, self.n_heads, d), k.view(b, self.n_kv_heads, d), v,
                None if member is None else member[:, 0], 1.0 / math.sqrt(d),
                cos=cos if rotary else None, sin=sin if rotary else None,
            )  # fmt: skip
            return self.w_o(out.transpose(1, 2).reshape(b, n, self.q_dim))
        q, k, v = self.w_qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.reshape(b, n, self.n_heads, d)
        k = k.reshape(b, n, self.n_kv_heads, d)
        v = v.reshape(b, n, self.n_kv_heads, d)
        if self.rotary_dim:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = flexible_attention(qt, kt, vt, causal=True, scale=1.0 / math.sqrt(d))
        if slot is not None:
            prefill_kv(slot, kt, vt, None if member is None else member.sum(dim=1))
        return self.w_o(out.transpose(1, 2).reshape(b, n, self.q_dim))
