"""Decoding cache: per (block, recursion) the keys, values, conv state and value-shift state.

A routed block application only sees the tokens routed through it, so each slot holds exactly
those tokens: ``length[b]`` counts them per sequence, and a token that skips the application
leaves the slot unchanged. Shapes stay fixed: a decode step always writes its key/value at
``length[b]`` and only advances ``length`` for the sequences whose token was routed in, so a
skipped token's write is overwritten by the next real one and never attended to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hydra_model.attention_backend import flexible_attention


@dataclass
class AttentionCache:
    k: torch.Tensor  # [B, n_kv, L, d]
    v: torch.Tensor  # [B, n_kv, L, d]
    length: torch.Tensor  # [B] long: tokens held per sequence
    #: CCGQA: the last (k_seq−1)+(k_ch−1) packed [q;k] pre-conv inputs [B, K−1, C]
    conv_state: torch.Tensor | None = None
    #: CCGQA: the previous held token's shifted-half value projection x·W_v2 [B, n_kv·d/2]
    #: (caching the projection instead of the hidden is the same maths, E/(n_kv·d/2) × smaller)
    prev_v: torch.Tensor | None = None


@dataclass
class CacheSlot:
    """One block application's cache; empty until the prefill pass fills it."""

    capacity: int
    entry: AttentionCache | None = None
    #: CCGQA: its conv weights and bias by form (headwise, folded, window), built once per
    #: generation (ccgqa.py)
    conv_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ModelCache:
    """All slots of one generation, keyed by (block index, recursion index).

    Every tensor a decode step changes is changed in place (keys, values, lengths, conv and
    value-shift state, routing counters, the position): a decode step captured once as a CUDA
    graph then advances the same state on every replay (decode_graphs.py)."""

    capacity: int
    seq_len: int = 0
    slots: dict[tuple[int, int], CacheSlot] = field(default_factory=dict)
    #: causal routing: tokens taken so far per routing point ([B] long), keyed like the slots
    #: ((block, −1) for MoD, (block, r) for MoR recursion r); see causal_routing.py
    counts: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: the next token's position [B, 1] long on the model's device, made by the first decode step
    #: (a device tensor, not ``seq_len``, so that a captured step reads the current value)
    position: torch.Tensor | None = None

    @property
    def decoding(self) -> bool:
        """True once the prefill pass has run: each later forward decodes one token."""
        return self.seq_len > 0

    def positions(self, batch: int, device: torch.device) -> torch.Tensor:
        """The decode step's positions [B, 1] (all ``seq_len``: prompts have equal lengths)."""
        if self.position is None:
            self.position = torch.full((batch, 1), self.seq_len, dtype=torch.long, device=device)
        return self.position

    def advance_host(self, n: int) -> None:
        """The host's count alone (a replayed decode graph advanced the device position)."""
        self.seq_len += n

    def advance(self, n: int) -> None:
        """After a forward of n tokens: the host's count and, once decoding, the device position."""
        self.seq_len += n
        if self.position is not None:
            self.position.add_(n)

    def slot(self, block: int, recursion: int) -> CacheSlot:
        key = (block, recursion)
        if key not in self.slots:
            self.slots[key] = CacheSlot(self.capacity)
        return self.slots[key]


def valid_length(count: torch.Tensor | None, batch: int, n: int, device: torch.device) -> torch.Tensor:
    """Per-sequence count of real tokens at the front of a (permuted) sequence; all n when None."""
    if count is None:
        return torch.full((batch,), n, dtype=torch.long, device=device)
    return count.to(torch.long)


def prefill_kv(
    slot: CacheSlot, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor | None
) -> AttentionCache:
    """Start ``slot`` from a full pass: k, v [B, n_kv, n, d] whose first ``count[b]`` are real."""
    b, h, n, d = k.shape
    if n > slot.capacity:
        raise ValueError(f"prompt of {n} tokens does not fit a cache of {slot.capacity}")
    kc = k.new_zeros(b, h, slot.capacity, d)
    vc = v.new_zeros(b, h, slot.capacity, d)
    kc[:, :, :n] = k
    vc[:, :, :n] = v
    # a copy: decoding advances it in place, and ``count`` may be the caller's tensor
    entry = AttentionCache(kc, vc, valid_length(count, b, n, k.device).clone())
    slot.entry = entry
    return entry


def decode_attend(
    entry: AttentionCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    write: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One decode step: q [B, Hq, 1, d], new k, v [B, n_kv, 1, d]; returns [B, Hq, 1, d].

    The new key/value goes to position ``length[b]``; ``length`` advances where ``write[b]``
    (all in place: see :class:`ModelCache`).
    """
    b, h, _, d = k.shape
    pos = entry.length  # [B]
    index = pos.view(b, 1, 1, 1).expand(b, h, 1, d)
    entry.k.scatter_(2, index, k.to(entry.k.dtype))
    entry.v.scatter_(2, index, v.to(entry.v.dtype))
    keys = torch.arange(entry.k.shape[2], device=k.device)
    mask = (keys.view(1, -1) <= pos.view(-1, 1)).view(b, 1, 1, -1)  # [B, 1, 1, L]
    out = flexible_attention(
        q, entry.k.to(q.dtype), entry.v.to(q.dtype), causal=False, attn_mask=mask, scale=scale
    )
    entry.length.add_(1 if write is None else write.to(pos.dtype))
    return out
