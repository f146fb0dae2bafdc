"""CCGQA: attention computed entirely in a compressed latent space (arXiv:2510.04476).

Steps (DESIGN.md §3): down-projections; causal convs on the packed [q;k] channels (depthwise
along the sequence, then head-wise grouped, both with bias, left padding only); q-k mean from the
pre-conv projections; value shift (half the value channels from x_t, half from x_{t−1}); QK norm
(√d/‖·‖, keys times exp(temperature) per kv head); partial RoPE; causal GQA attention with
scale 1/√d; output projection.

The three down-projections share one matmul (W_q | W_k | W_v1 | W_v2 stacked by rows). The value
shift moves the x·W_v2 projection one step instead of x itself: the projection is linear without
bias, so this is the same value and it lets the decoding cache keep n_kv·d/2 numbers, not E.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import qk_norm, rope
from hydra_model.attention_backend import flexible_attention
from hydra_model.cache import AttentionCache, CacheSlot, decode_attend, prefill_kv, valid_length


class CCGQAAttention(nn.Module):
    """Compressed convolutional grouped-query attention on x [B, n, E] → [B, n, E]."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        conv_kernel_seq: int = 2,
        conv_kernel_ch: int = 2,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if head_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"head_dim={head_dim} must be even and ≥ rotary_dim={rotary_dim}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.q_dim = n_heads * head_dim
        self.kv_dim = n_kv_heads * head_dim
        self.qk_channels = self.q_dim + self.kv_dim
        self.k_seq, self.k_ch = conv_kernel_seq, conv_kernel_ch
        #: conv state length: (k_seq − 1) + (k_ch − 1) past packed inputs
        self.conv_context = conv_kernel_seq - 1 + conv_kernel_ch - 1
        # rows: [W_q (q_dim) | W_k (kv_dim) | W_v1 (kv_dim/2) | W_v2 (kv_dim/2)]
        self.w_qkv = nn.Linear(dim, self.qk_channels + self.kv_dim, bias=False)
        self.conv_seq = nn.Conv1d(
            self.qk_channels, self.qk_channels, conv_kernel_seq, groups=self.qk_channels
        )
        self.conv_ch = nn.Conv1d(
            self.qk_channels, self.qk_channels, conv_kernel_ch, groups=n_heads + n_kv_heads
        )
        #: per-kv-head key temperature, exp(0) = 1 at init
        self.temperature = nn.Parameter(torch.zeros(n_kv_heads))
        self.w_o = nn.Linear(self.q_dim, dim, bias=False)

    def _convs(self, u_ch_first: torch.Tensor) -> torch.Tensor:
        """Both convolutions without padding: [B, C, n + K−1] → [B, C, n]."""
        z = F.conv1d(u_ch_first, self.conv_seq.weight, self.conv_seq.bias, groups=self.qk_channels)
        return F.conv1d(z, self.conv_ch.weight, self.conv_ch.bias, groups=self.n_heads + self.n_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        *,
        slot: CacheSlot | None = None,
        member: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, n, E]; cos/sin [n, R/2] or [B, n, R/2].

        Without ``slot``: causal over the n tokens. With an empty ``slot``: the same, then the
        slot is filled from the real tokens, which ``member`` [B, n] (prefix mask; None = all)
        marks. With a filled slot: one decode step (n == 1) whose token joins the cache where
        ``member[b, 0]`` (all when None).
        """
        b, n, _ = x.shape
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        entry = slot.entry if slot is not None else None
        proj = self.w_qkv(x)  # [B, n, C + kv_dim]
        u = proj[..., : self.qk_channels]  # packed pre-conv [q;k], [B, n, C]
        v_raw = proj[..., self.qk_channels :]  # [B, n, kv_dim]: [x·W_v1 | x·W_v2]
        half = self.kv_dim // 2

        # 2. causal convs over the sequence (left context: zeros, or the cached inputs)
        if entry is None:
            window = F.pad(u.transpose(1, 2), (self.conv_context, 0))  # [B, C, n + K−1]
        else:
            window = torch.cat([entry.conv_state.to(u.dtype), u], dim=1).transpose(1, 2)
        z = self._convs(window).transpose(1, 2)  # [B, n, C]

        # 3. q-k mean from the pre-conv projections
        groups = hq // hkv
        q_pre = u[..., : self.q_dim].reshape(b, n, hkv, groups, d)
        k_pre = u[..., self.q_dim :].reshape(b, n, hkv, 1, d)
        qk_mean = 0.5 * (q_pre + k_pre)  # [B, n, n_kv, G, d]
        q = z[..., : self.q_dim].reshape(b, n, hq, d) + qk_mean.reshape(b, n, hq, d)
        k = z[..., self.q_dim :].reshape(b, n, hkv, d) + qk_mean.mean(dim=3)

        # 4. value shift: channels [0, half) from x_t, [half, kv_dim) from x_{t−1} (zero at t=0)
        shifted_src = v_raw[..., half:]  # [B, n, half]
        if entry is None:
            v_prev = F.pad(shifted_src, (0, 0, 1, 0))[:, :n]
        else:
            v_prev = entry.prev_v.to(v_raw.dtype).unsqueeze(1)
        v = torch.cat([v_raw[..., :half], v_prev], dim=-1).reshape(b, n, hkv, d)

        # 5. QK norm, 6. RoPE on the normalised latent q, k
        scale = math.sqrt(d)
        q = qk_norm(q, scale, None)
        k = qk_norm(k, scale, self.temperature)
        if self.rotary_dim:
            q, k = rope(q, cos, sin), rope(k, cos, sin)

        # 7. causal GQA attention in the latent space, softmax scale 1/√d
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, n, d]
        if entry is None:
            out = flexible_attention(qt, kt, vt, causal=True, scale=1.0 / scale)
            if slot is not None:
                count = None if member is None else member.sum(dim=1)
                self._fill_slot(slot, kt, vt, u, shifted_src, count)
        else:
            write_mask = torch.ones(b, dtype=torch.bool, device=x.device) if member is None else member[:, 0]
            out = decode_attend(entry, qt, kt, vt, write_mask, 1.0 / scale)
            self._advance_state(entry, u, shifted_src, write_mask)

        # 8. output projection
        return self.w_o(out.transpose(1, 2).reshape(b, n, self.q_dim))

    def _fill_slot(self, slot, kt, vt, u, shifted_src, count) -> None:
        entry = prefill_kv(slot, kt, vt, count)
        b, n, _ = u.shape
        length = valid_length(count, b, n, u.device)  # [B]
        ctx = self.conv_context
        # last `ctx` real inputs: in the left-padded sequence they sit at length .. length+ctx−1
        padded = F.pad(u, (0, 0, ctx, 0))  # [B, n + ctx, C]
        idx = length.view(b, 1) + torch.arange(ctx, device=u.device).view(1, -1)  # [B, ctx]
        entry.conv_state = padded.gather(1, idx.unsqueeze(-1).expand(b, ctx, u.shape[-1]))
        prev = F.pad(shifted_src, (0, 0, 1, 0))  # [B, n + 1, half]: row j is token j−1
        entry.prev_v = prev.gather(1, length.view(b, 1, 1).expand(b, 1, prev.shape[-1])).squeeze(1)

    def _advance_state(self, entry: AttentionCache, u, shifted_src, write_mask) -> None:
        keep = write_mask.view(-1, 1, 1)
        if self.conv_context:
            rolled = torch.cat([entry.conv_state[:, 1:], u.to(entry.conv_state.dtype)], dim=1)
            entry.conv_state = torch.where(keep, rolled, entry.conv_state)
        entry.prev_v = torch.where(keep[:, 0], shifted_src[:, 0].to(entry.prev_v.dtype), entry.prev_v)
