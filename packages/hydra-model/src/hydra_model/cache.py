"""Decoding cache: per (block, recursion) the keys, values, conv state and value-shift state.

A routed block application only sees the tokens routed through it, so each slot holds exactly
those tokens: ``length[b]`` counts them per sequence, and a token that skips the application
leaves the slot unchanged. Shapes stay fixed: a decode step always writes its key/value at
``length[b]`` and only advances ``length`` for the sequences whose token was routed in, so a
skipped token's write is overwritten by the next real one and never attended to.

A decode step's attention inputs and every state update are one kernel
(``hydra_kernels.ops.kv_decode``, :func:`decode_attend`): the QK norm and RoPE of the new query
and key, the key/value writes, the attention mask and the length. The mask is kept in the slot as
an additive bias (0 for held keys, −inf beyond; the step opens the current position), so no step
builds one; SDPA then needs no boolean → additive conversion either. CCGQA's conv state lives in
the slot's working row (``AttentionCache.window``) that the step's projection is written into, so
its conv window is a view and the same kernel rolls it. At batch 1 the launches, not the
arithmetic, bound a graphed step: together this took the dense GPT's layer from 17 kernels to 10
and HYDRA's unrouted block from 27 to 13 with ``decode_conv="window_gemm"`` (34 to 20 head-wise),
as packages/hydra-diag/bench/decode_kernels.py counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hydra_kernels.ops.kv_decode import kv_decode_step
from hydra_kernels.ops.kv_prefill import kv_prefill_
from hydra_model.attention_backend import flexible_attention


@dataclass
class AttentionCache:
    k: torch.Tensor  # [B, n_kv, L, d]
    v: torch.Tensor  # [B, n_kv, L, d]
    length: torch.Tensor  # [B] long: tokens held per sequence
    #: additive attention mask [B, L] in the keys' dtype: 0 for the held keys (and, during a
    #: step, the current position), −inf beyond; a decode step opens its position in place
    bias: torch.Tensor | None = None
    #: CCGQA: the last (k_seq−1)+(k_ch−1) packed [q;k] pre-conv inputs [B, K−1, C], a view of
    #: the first (K−1)·C columns of ``window``
    conv_state: torch.Tensor | None = None
    #: CCGQA: the previous held token's shifted-half value projection x·W_v2 [B, n_kv·d/2]
    #: (caching the projection instead of the hidden is the same maths, E/(n_kv·d/2) × smaller)
    prev_v: torch.Tensor | None = None
    #: CCGQA: a decode step's working row per sequence, [B, (K−1)·C + C + n_kv·d]: the conv state,
    #: then the step's projection [u | x·W_v1 | x·W_v2] written there by its matmul, so that the
    #: first K·C columns are the conv window with no cat; the step rolls the state in place
    window: torch.Tensor | None = None


@dataclass(eq=False)
class ConvBank:
    """CCGQA's conv weights of one cache by (module, form), built once per generation (the
    weights cannot change while decoding) and shared by all its slots (a MoR block's recursions
    share their module). ``modules``: the model's CCGQA modules, which the model's forward lists
    at the prefill so that the first module's request builds the form for all of them together
    (ccgqa_fold.py); empty, each module builds its own."""

    modules: list = field(default_factory=list)
    weights: dict = field(default_factory=dict)
    #: (module, form) → the conv parameters the weights were built from (ccgqa_fold.conv_sources)
    sources: dict = field(default_factory=dict)

    def drop_replaced(self) -> None:
        """Forget the weights of modules whose conv parameters are no longer the tensors they were
        built from (a model cast or moved since: ``model.to(torch.bfloat16)``); the next prefill
        builds them again. Tensors are told apart by address, dtype, shape and device, so weights
        changed in place are not seen here, nor a new tensor that took a freed one's address and
        layout: a kept decoder's fingerprint checks the content (decoder_hold.py)."""
        from hydra_model.ccgqa_fold import conv_sources

        now: dict = {}  # per module, not per (module, form)
        for key in list(self.weights):
            module = key[0]
            if module not in now:
                now[module] = conv_sources(module)
            if self.sources.get(key) != now[module]:
                del self.weights[key]
                self.sources.pop(key, None)


@dataclass
class CacheSlot:
    """One block application's cache; empty until the prefill pass fills it."""

    capacity: int
    entry: AttentionCache | None = None
    #: the last generation's entry, set aside by :meth:`ModelCache.restart`: the next prefill
    #: writes into its tensors (:func:`prefill_kv`)
    spare: AttentionCache | None = None
    #: CCGQA: the conv weights (its cache's bank; a slot made on its own has one of its own)
    bank: ConvBank = field(default_factory=ConvBank)


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
    #: CCGQA's conv weights, shared by the slots (:class:`ConvBank`); kept by :meth:`restart`
    conv_bank: ConvBank = field(default_factory=ConvBank, repr=False, compare=False)
    #: the tensors' storage when :meth:`restart` ran (what :meth:`refilled_in_place` compares)
    _kept: dict | None = field(default=None, repr=False, compare=False)

    @property
    def decoding(self) -> bool:
        """True once the prefill pass has run: each later forward decodes one token."""
        return self.seq_len > 0

    def positions(self, batch: int, device: torch.device) -> torch.Tensor:
        """The decode step's positions [B, 1] (all ``seq_len``: prompts have equal lengths)."""
        if self.position is None or self.position.shape[0] != batch:  # new, or a restart's of another batch
            self.position = torch.full((batch, 1), self.seq_len, dtype=torch.long, device=device)
        return self.position

    def check_room(self, n: int) -> None:
        """Raise before a decode step of n tokens that would not fit: the fused step kernel
        (hydra_kernels.ops.kv_decode) writes nothing past the capacity, so a step there would
        lose its key and value silently."""
        if self.seq_len + n > self.capacity:
            raise ValueError(
                f"the cache holds {self.capacity} tokens and has {self.seq_len}: no room for {n} more "
                "(make the cache with a larger capacity, e.g. prompt + max_new_tokens)"
            )

    def restart(self, weights_checked: bool = False) -> None:
        """Empty the cache for a new prompt but keep its tensors: the next prefill writes into
        them in place, so a decode step captured on them replays the new generation
        (decoder_hold.py). Counters and the position go back to zero as in a new cache; the next
        prompt may have another batch size (the tensors of the old one are then replaced). The
        conv weights are kept unless the model's conv parameters were replaced since
        (:meth:`ConvBank.drop_replaced`); after changing weights in place, use a new cache.
        ``weights_checked``: the caller has already found every model tensor to be the one the
        cache was filled with (a kept decoder's fingerprint), so the bank is not looked at again."""
        if not weights_checked:
            self.conv_bank.drop_replaced()
        self._kept = self._storage()
        self.seq_len = 0
        for slot in self.slots.values():
            slot.spare, slot.entry = slot.entry or slot.spare, None
        for count in self.counts.values():
            count.zero_()
        if self.position is not None:
            self.position.zero_()

    def refilled_in_place(self) -> bool:
        """After :meth:`restart` and a prefill: every tensor a decode step reads kept its storage."""
        return self._kept is not None and self._storage() == self._kept

    def _storage(self) -> dict:
        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        out: dict = {("position",): ptr(self.position)}
        out.update({("count", *key): ptr(c) for key, c in self.counts.items()})
        for key, slot in self.slots.items():  # a slot the prefill did not fill shows no entry
            e = slot.entry
            held = None if e is None else (e.k, e.v, e.length, e.bias, e.window, e.prev_v)
            out[("slot", *key)] = None if held is None else tuple(map(ptr, held))
        return out

    def snapshot(self) -> tuple:
        """The cache's host-side references: its position, counters, slot entries and conv
        weights (not their values). :meth:`rollback` restores them: a decode step captured
        before it ever ran (decode_graphs.py) that made one of these made it inside the graph,
        where its values are never computed, and is undone."""
        slots = {key: (slot.entry, slot.spare) for key, slot in self.slots.items()}
        return self.position, dict(self.counts), slots, dict(self.conv_bank.weights), self.seq_len

    def rollback(self, snapshot: tuple) -> None:
        """Back to ``snapshot``'s references (:meth:`snapshot`)."""
        self.position, counts, slots, weights, self.seq_len = snapshot
        self.counts.clear()
        self.counts.update(counts)
        for key in [k for k in self.slots if k not in slots]:
            del self.slots[key]
        for key, (entry, spare) in slots.items():
            self.slots[key].entry, self.slots[key].spare = entry, spare
        self.conv_bank.weights.clear()
        self.conv_bank.weights.update(weights)

    @staticmethod
    def same_references(a: tuple, b: tuple) -> bool:
        """Two snapshots hold the same objects (compared by identity; the host's count aside)."""

        def ids(snap: tuple) -> tuple:
            position, counts, slots, weights, _ = snap
            entries = tuple((k, id(e), id(sp)) for k, (e, sp) in slots.items())
            counters = tuple((k, id(v)) for k, v in counts.items())
            return id(position), counters, entries, tuple(map(id, weights.values()))

        return ids(a) == ids(b)

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
            self.slots[key] = CacheSlot(self.capacity, bank=self.conv_bank)
        return self.slots[key]


def prefill_kv(
    slot: CacheSlot, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor | None
) -> AttentionCache:
    """Start ``slot`` from a full pass: k, v [B, n_kv, n, d] whose first ``count[b]`` are real
    (all n when None). The keys, values, lengths and mask in one kernel (hydra_kernels'
    kv_prefill_: at batch 1 a prefill is bound by its launches), into a restarted cache's tensors
    where it has them (a captured decode step reads those)."""
    b, h, n, d = k.shape
    if n > slot.capacity:
        raise ValueError(f"prompt of {n} tokens does not fit a cache of {slot.capacity}")
    old, slot.spare = slot.spare, None  # a restarted cache's entry: its tensors are rewritten
    shape, dev = (b, h, slot.capacity, d), k.device
    entry = AttentionCache(
        kept_or_new(None if old is None else old.k, shape, k.dtype, dev),
        kept_or_new(None if old is None else old.v, shape, v.dtype, dev),
        # a copy: decoding advances it in place, and ``count`` may be the caller's tensor
        kept_or_new(None if old is None else old.length, (b,), torch.long, dev),
        kept_or_new(None if old is None else old.bias, (b, slot.capacity), k.dtype, dev),
    )
    if old is not None:  # CCGQA's conv and value-shift state, rewritten by its prefill (ccgqa.py)
        entry.window, entry.conv_state, entry.prev_v = old.window, old.conv_state, old.prev_v
    # detached: the cache keeps no autograd history (the op's reference runs where the kernel can't)
    kv_prefill_(k.detach(), v.detach(), entry.k, entry.v, entry.bias, entry.length, count)
    slot.entry = entry
    return entry


def kept_or_new(
    old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``old`` where it is a tensor of ``shape``, ``dtype`` and ``device`` (a restarted cache's,
    which a captured decode step reads: :meth:`ModelCache.restart`), else a new uninitialised
    one: the caller writes it whole."""
    if old is not None and old.shape == shape and old.dtype == dtype and old.device == device:
        return old
    return torch.empty(shape, dtype=dtype, device=device)


def refill(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` with new's values copied in when it has new's shape and dtype: a
    restarted cache keeps the tensors a captured decode step reads (:meth:`ModelCache.restart`)."""
    if old is not None and old.shape == new.shape and old.dtype == new.dtype:
        return old.copy_(new)
    return new


def put_count(counts: dict, key: tuple, value: torch.Tensor) -> None:
    """``counts[key] = value``, into the counter already there (:func:`refill`)."""
    counts[key] = refill(counts.get(key), value)


def decode_attend(
    entry: AttentionCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    write: torch.Tensor | None,
    scale: float,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    norm_scale: float | None = None,
    k_temperature: torch.Tensor | None = None,
    v_tail: torch.Tensor | None = None,
    v_tail_next: torch.Tensor | None = None,
    roll: torch.Tensor | None = None,
    roll_shift: int = 0,
) -> torch.Tensor:
    """One decode step: q [B, Hq, d], the new k [B, n_kv, d] and value v [B, n_kv·d] (or [B, V1]
    with ``v_tail`` [B, n_kv·d − V1] the rest); returns the attention output [B, Hq, 1, d].
    (q, k, v as [B, H, 1, d] are taken too.)

    With ``norm_scale`` q and k are QK-normed first (``k_temperature`` [n_kv]: the keys' gain),
    with ``cos``/``sin`` ([B, R/2], [B, 1, R/2] or [1, R/2]) rotated; the key and value go to
    position ``length[b]``, which attends too; ``length`` and the mask advance where ``write[b]``
    (None: every row). ``v_tail_next`` replaces ``v_tail`` and ``roll[:, :W − roll_shift] ←
    roll[:, roll_shift:]`` where written (CCGQA's value shift and conv window). All in place in
    one kernel (``hydra_kernels.ops.kv_decode``; see :class:`ModelCache`).
    """
    b = q.shape[0]
    if q.dim() == 4:  # [B, H, 1, d]
        if q.shape[2] != 1:
            raise ValueError(f"decode_attend: one token per sequence, got q {tuple(q.shape)}")
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0].reshape(b, -1)
    if write is not None and write.dtype != torch.bool:
        write = write != 0
    if cos is not None and cos.dim() == 3:  # [B, 1, R/2]: a row per sequence
        cos, sin = cos[:, 0], sin[:, 0]
    if cos is not None and cos.dim() == 2 and cos.shape[0] != b:  # [1, R/2]: shared
        cos, sin = cos[0], sin[0]
    q_out = kv_decode_step(
        q, k, v, entry.k, entry.v, entry.length, entry.bias, write=write, cos=cos, sin=sin,
        norm_scale=norm_scale, k_temperature=k_temperature, v_tail=v_tail, v_tail_next=v_tail_next,
        roll=roll, roll_shift=roll_shift,
    )  # fmt: skip
    length = entry.k.shape[2]
    mask = entry.bias.view(b, 1, 1, length).to(q_out.dtype)
    return flexible_attention(
        q_out.view(b, -1, 1, q.shape[-1]), entry.k.to(q_out.dtype), entry.v.to(q_out.dtype),
        causal=False, attn_mask=mask, scale=scale,
    )  # fmt: skip
