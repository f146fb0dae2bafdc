"""The dense baseline's plain GQA attention against an fp64 reference, and its cached decoding."""

from __future__ import annotations

import math

import torch

from hydra_model import GQAAttention, RotaryEmbedding
from hydra_model.cache import CacheSlot


def _reference(attn: GQAAttention, x: torch.Tensor, base=10000.0) -> torch.Tensor:
    x = x.double()
    b, n, _ = x.shape
    hq, hkv, d, r = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.rotary_dim
    w = attn.w_qkv.weight.double()
    q = (x @ w[: hq * d].t()).view(b, n, hq, d)
    k = (x @ w[hq * d : (hq + hkv) * d].t()).view(b, n, hkv, d)
    v = (x @ w[(hq + hkv) * d :].t()).view(b, n, hkv, d)
    ang = torch.arange(n, dtype=torch.float64).unsqueeze(-1) * base ** (-torch.arange(r // 2) * 2 / r)
    cos, sin = ang.cos().view(1, n, 1, -1), ang.sin().view(1, n, 1, -1)

    def rot(t):
        a, c, rest = t[..., : r // 2], t[..., r // 2 : r], t[..., r:]
        return torch.cat([a * cos - c * sin, c * cos + a * sin, rest], -1)

    q, k = rot(q), rot(k)
    out = torch.zeros(b, n, hq, d, dtype=torch.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        s = torch.einsum("bsd,btd->bst", q[:, :, h], k[:, :, g]) / math.sqrt(d)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = s.softmax(-1) @ v[:, :, g]
    return out.reshape(b, n, hq * d) @ attn.w_o.weight.double().t()


def test_plain_gqa_matches_reference_and_decodes_like_the_full_forward():
    torch.manual_seed(0)
    attn = GQAAttention(36, 6, 3, 6, 4)
    rope = RotaryEmbedding(4, 32)
    x = torch.randn(2, 9, 36)
    cos, sin = rope.tables(9)
    full = attn(x, cos, sin)
    torch.testing.assert_close(full.double(), _reference(attn, x), atol=1e-5, rtol=1e-5)
    slot = CacheSlot(capacity=9)
    pc, ps = rope.tables(5)
    attn(x[:, :5], pc, ps, slot=slot)
    for t in range(5, 9):
        c, s = rope.tables(positions=torch.full((2, 1), t))
        step = attn(x[:, t : t + 1], c, s, slot=slot)
        torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert slot.entry.length.tolist() == [9, 9]
