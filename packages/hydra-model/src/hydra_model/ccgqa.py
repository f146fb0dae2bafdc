"""CCGQA: attention computed entirely in a compressed latent space (arXiv:2510.04476).

The eight steps: down-projections; causal convs on the packed [q;k] channels (depthwise along
the sequence, then head-wise grouped, both with bias, left padding only); q-k mean from the
pre-conv projections; value shift (half the value channels from x_t, half from x_{t−1}); QK norm
(√d/‖·‖, keys times exp(temperature) per kv head); partial RoPE; causal GQA attention with
scale 1/√d; output projection.

The three down-projections share one matmul (W_q | W_k | W_v1 | W_v2 stacked by rows). The value
shift moves the x·W_v2 projection one step instead of x itself: the projection is linear without
bias, so this is the same value and it lets the decoding cache keep n_kv·d/2 numbers, not E.

The two convolutions are linear in the packed pre-conv inputs u of the last K = k_seq + k_ch − 1
tokens, and the head-wise conv never mixes heads, so per head they are K small [d, d] products
summed over the window offsets, with a per-head folded weight [heads, d, d·K] built from the conv
weights each forward, every block's at once (ccgqa_fold.py's ``headwise`` form, ``fold_blocks``:
the depthwise conv scales its columns). hydra_kernels' ``ccgqa_conv`` runs them reading the
left-padded u in place; its reference (what ran before) unfolds the window per head
[B, n, heads, d·K], copied once, into one batched matmul. The q-k mean reads only the current
token's inputs; the conv kernels add it (and its transpose to u's gradient) themselves, where it
was an elementwise pass of its own over u and the conv's output. This replaces two cuDNN
depthwise/grouped conv1d calls (and their slow weight-gradient kernels) and two layout transposes.
An earlier form (``folded``, kept for ``conv_impl = "folded"``) ran convs and q-k mean
as one [C, C·K] GEMM whose block-diagonal weight spends (heads − 1)/heads of its work on zeros:
at the dense GPT's head layout (C = 1024, 16 heads) that GEMM cost more than the MLP's up
projection, which made the ``gpt-ccgqa`` race entrant 22% slower than ``gpt``
(packages/hydra-model/BENCHMARKS.md, "CCGQA conv stage").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import ccgqa_conv, qk_norm, qk_norm_rope
from hydra_kernels.ops.ccgqa_prefill import ccgqa_prefill, ccgqa_prefill_ref, shifted_values
from hydra_kernels.ops.tile_linear import tile_linear
from hydra_model import ccgqa_fold
from hydra_model.attention_backend import flexible_attention
from hydra_model.cache import CacheSlot, decode_attend, kept_or_new, prefill_kv
from hydra_model.options import OPTIONS


def qk_mean_matrix(n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[C, C] matrix M with (M·u)[query h] = (q_pre[h] + k_pre[h//G])/2 and (M·u)[kv g] = the mean
    of those over g's G query heads, for packed u = [q_pre (n_heads·d) ; k_pre (n_kv_heads·d)]."""
    groups = n_heads // n_kv_heads
    q_dim, c = n_heads * head_dim, (n_heads + n_kv_heads) * head_dim
    eye = torch.eye(head_dim)
    m = torch.zeros(c, c)
    for h in range(n_heads):
        g = h // groups
        qh = slice(h * head_dim, (h + 1) * head_dim)
        kg = slice(q_dim + g * head_dim, q_dim + (g + 1) * head_dim)
        m[qh, qh] += 0.5 * eye
        m[qh, kg] += 0.5 * eye
        m[kg, qh] += 0.5 / groups * eye  # kv head g: mean over its group of (q_pre[h] + k_pre[g]) / 2
        m[kg, kg] += 0.5 / groups * eye
    return m


def list_conv_modules(model: nn.Module, cache) -> None:
    """Before a prefill into ``cache`` (a ModelCache or None): list ``model``'s CCGQA modules in
    the cache's conv bank, once, so that the first module's conv weights are built together with
    every other's (ccgqa_fold.py)."""
    if cache is not None and not cache.seq_len and not cache.conv_bank.modules:
        # listed once per model (a walk of every module costs a prefill about a millisecond);
        # a module swapped in later is still built, on its own request (ccgqa_fold.py)
        listed = model.__dict__.get("_ccgqa_modules")
        if listed is None:
            listed = [m for m in model.modules() if isinstance(m, CCGQAAttention)]
            model.__dict__["_ccgqa_modules"] = listed
        cache.conv_bank.modules = listed


def window_form() -> str:
    """The decode steps' conv weight form for ``decode_conv`` (hydra_model.options) when it is
    not ``headwise``: its non-zero tiles, or the dense window weight."""
    return "window_tiles" if OPTIONS.decode_conv == "window_tiles" else "window"


#: a prefill of at most this many tokens (batch × prompt) runs its convs with the decode steps'
#: window weight (``CCGQAAttention._conv_qk_prefill``), longer ones head-wise. A prefill this size
#: is bound by its host launches (two a block here, eight head-wise): on an H100 the window form
#: took 1.9–2.4 ms less host time at 512, 1024 and 2048 tokens (packages/hydra-model/BENCHMARKS.md)
PREFILL_WINDOW_ROWS = 2048
#: how the convs run: "headwise" (a GEMM per head plus an elementwise q-k mean) or "folded"
#: (one block-diagonal GEMM with the q-k mean inside); see the module docstring
CONV_IMPLS = ("headwise", "folded")


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
        conv_impl: str = "headwise",
    ) -> None:
        super().__init__()
        if conv_impl not in CONV_IMPLS:
            raise ValueError(f"conv_impl={conv_impl!r}; expected one of {CONV_IMPLS}")
        self.conv_impl = conv_impl
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
        #: the q-k mean as a constant [C, C] matrix on the current token's pre-conv inputs
        self.register_buffer("qk_mean_mix", qk_mean_matrix(n_heads, n_kv_heads, head_dim), persistent=False)

    def rebuild_constants(self) -> None:
        """Refill the constant q-k mean matrix (after a model was built on the meta device)."""
        mix = qk_mean_matrix(self.n_heads, self.n_kv_heads, self.head_dim)
        self.qk_mean_mix = mix.to(self.qk_mean_mix.device, self.qk_mean_mix.dtype)

    def _conv_qk(
        self,
        window: torch.Tensor,
        slot: CacheSlot | None = None,
        conv: tuple | None = None,
        zero_context: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2–3 on a time-major window [B, n + K−1, C] of packed pre-conv inputs (K−1 rows of
        left context) → pre-norm q [B, n, n_heads, d] and k [B, n, n_kv_heads, d]. ``conv``: the
        folded weight and bias, where the caller has them. ``zero_context`` (the headwise form
        only): ``window`` is [B, n, C] and its context rows are zeros, which the kernels mask."""
        b, length, c = window.shape
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        k_total = self.conv_context + 1
        n = length if zero_context else length - self.conv_context
        weight, bias = conv if conv is not None else self._folded(slot)
        if self.conv_impl == "folded":
            taps = window.unfold(1, k_total, 1).reshape(b, n, c * k_total)  # [c, s] = u[t+s, c]
            q, k = F.linear(taps, weight, bias).split([self.q_dim, self.kv_dim], dim=-1)
            return q.view(b, n, hq, d), k.view(b, n, hkv, d)
        # each head's [d, d·K] block (columns i·K + s) as K [out, in] matrices; hydra_kernels'
        # ccgqa_conv reads the window in place (its reference unfolds it and runs one GEMM a head)
        # and adds the q-k mean of the current token's inputs: query head h gets (q_pre[h] +
        # k_pre[h // G])/2, kv head g the mean of those over its G query heads
        per_tap = weight.view(hq + hkv, d, d, k_total).permute(0, 3, 1, 2)  # [heads, K, d, d]
        z = ccgqa_conv(window, per_tap, bias, zero_context, qk_mean_heads=hq)  # [B, n, heads, d]
        return z[:, :, :hq], z[:, :, hq:]

    def _conv_qk_window(self, window: torch.Tensor, slot: CacheSlot) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's steps 2–3 (``decode_conv="window_gemm"``): the window [B, K·C] of one
        token in its memory order (the slot's working row, ``AttentionCache.window``) times a
        [C, K·C] weight holding both convs and the q-k mean, built once per generation; one GEMM
        and no copy where the head-wise form launches a copy, a batched GEMM and five elementwise
        kernels. Its weight is (heads − 1)/heads zeros, 6 MB at the 100M preset: a few µs of
        reading at batch 1, where a step is bound by launches. → q [B, n_heads, d], k [B, n_kv, d]
        (views of the GEMM's output)."""
        b = window.shape[0]
        q, k = self._window_product(window, slot).split([self.q_dim, self.kv_dim], dim=-1)
        return q.view(b, self.n_heads, self.head_dim), k.view(b, self.n_kv_heads, self.head_dim)

    def _window_product(self, taps: torch.Tensor, slot: CacheSlot) -> torch.Tensor:
        """[R, K·C] or [B, n, K·C] windows (columns s·C + c) → [R, C] or [B, n, C]: the convs and
        the q-k mean."""
        form = window_form()
        weight, bias = self._folded(slot, form)
        if form == "window_tiles":
            # the same weight as its non-zero tiles (ccgqa_fold.WINDOW_TILE): one kernel reading
            # ~1/10 of it, where cuBLAS launches a split-K GEMM and its reduction (tile_linear)
            return tile_linear(taps, weight, bias)
        return F.linear(taps, weight.to(taps.dtype), bias.to(taps.dtype))

    def _conv_qk_prefill(self, window: torch.Tensor, slot: CacheSlot) -> torch.Tensor:
        """A short prompt's steps 2–3 with the decode steps' window weight: each token's window
        in a decode step's memory order, one product (one launch where the head-wise form takes
        eight; a prefill this short is bound by its launches). The windows of a row-contiguous
        window are a view (token t's is K·C consecutive numbers from row t), which the tiled
        product reads in place; the dense one may copy them.
        window [B, n + K−1, C] → [B, n, n_heads + n_kv_heads, d]: the query heads, then the kv heads."""
        b, length, _ = window.shape
        k_total = self.conv_context + 1
        n = length - self.conv_context
        taps = window.unfold(1, k_total, 1).transpose(2, 3).flatten(2)  # [B, n, s·C + c]
        return self._window_product(taps, slot).view(b, n, self.n_heads + self.n_kv_heads, self.head_dim)

    def _joint_temperature(self, slot: CacheSlot) -> torch.Tensor:
        """[n_heads + n_kv_heads]: 0 for the query heads (exp(0) = 1: their norm unchanged), the
        key temperature for the kv heads; built once per generation with the conv weights."""
        return self._folded(slot, "joint_temperature")[0]

    def _folded(
        self, slot: CacheSlot | None = None, form: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv weight and bias in ``form`` (``conv_impl``'s by default; see ccgqa_fold.py). A
        decoding slot's bank keeps it for the whole generation (the weights cannot change while
        decoding: rebuilding it every token was most of a decode step's time), built together
        with the model's other CCGQA modules (:class:`~hydra_model.cache.ConvBank`). Anywhere
        else it is built per call (a cache keyed on the parameters would go stale under
        optimizers that update them in place without a version bump)."""
        form = form or self.conv_impl
        if slot is None or torch.is_grad_enabled():
            return self._build_folded(form)
        if (self, form) not in slot.bank.weights:
            ccgqa_fold.fold_into_bank(slot.bank, self, form)
        return slot.bank.weights[(self, form)]

    def _build_folded(self, form: str) -> tuple[torch.Tensor, torch.Tensor]:
        return ccgqa_fold.fold_many([self], form)[0]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        *,
        slot: CacheSlot | None = None,
        member: torch.Tensor | None = None,
        conv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [B, n, E]; cos/sin [n, R/2] or [B, n, R/2].

        Without ``slot``: causal over the n tokens. With an empty ``slot``: the same, then the
        slot is filled from the real tokens, which ``member`` [B, n] (prefix mask; None = all)
        marks. With a filled slot: one decode step (n == 1) whose token joins the cache where
        ``member[b, 0]`` (all when None). ``conv``: this module's conv weight and bias in its
        ``conv_impl`` form, folded by the caller (a forward without a cache folds every block's at
        once, ccgqa_fold.fold_blocks); None: folded here.
        """
        if slot is not None and slot.entry is not None:
            return self._decode_step(x, cos, sin, slot, member)
        b, n, _ = x.shape
        hkv, d = self.n_kv_heads, self.head_dim
        proj = self.w_qkv(x)  # [B, n, C + kv_dim]: [u | x·W_v1 | x·W_v2]
        c, ctx = self.qk_channels, self.conv_context
        # a prefill's [B] real tokens (member: a prefix mask; None = all)
        count = None if member is None or slot is None else member.sum(dim=1)
        state = None if slot is None else self._state_buffers(slot, proj)
        zero_context = False  # True: ``window`` is u [B, n, C]; its K−1 context rows are zeros
        if torch.is_grad_enabled() and slot is None and self.conv_impl == "headwise":
            # training: the conv kernels read u in place and mask the zero context (no padded
            # copy); 4. the value shift (channels [0, half) from x_t, [half, kv_dim) from x_{t−1},
            # zero at t=0)
            window, v = shifted_values(proj, c)
            zero_context = True
        elif torch.is_grad_enabled():
            # the op's reference, differentiable: window [B, n + K−1, C] (left context zeros) and
            # the value shift; it splits proj, so the backward writes one [B, n, C + kv_dim]
            # gradient (a cat)
            window, v, *_ = ccgqa_prefill_ref(proj, c, ctx)
            if state is not None:  # the slot's state, from a detached projection: no autograd history
                self._write_state(proj.detach(), count, state, views=False)
        else:  # the same copies and a prefill's slot state in one launch (bound by launches)
            window, v, *_ = self._write_state(proj, count, state, views=True)
        v = v.reshape(b, n, hkv, d)

        # 2.–3. causal convs over the sequence and the q-k mean
        scale = math.sqrt(d)
        joint = None  # q and k as one [B, n, n_heads + n_kv_heads, d] tensor, where they are
        if slot is not None and OPTIONS.decode_conv != "headwise" and not torch.is_grad_enabled():
            # the decode steps' weight, built now: a captured step must find it (decode_graphs.py)
            self._folded(slot, window_form())
            if b * n <= PREFILL_WINDOW_ROWS:
                joint = self._conv_qk_prefill(window, slot)
            else:
                q, k = self._conv_qk(window, slot)
        else:  # [B, n, n_heads, d], [B, n, n_kv_heads, d]
            q, k = self._conv_qk(window, slot, conv, zero_context=zero_context)

        # 5. QK norm, 6. RoPE on the normalised latent q, k (one kernel each way, as the two
        # ops round: hydra_kernels/ops/qk_norm_rope.py)
        if joint is not None:  # a short prefill: both in one launch (bound by launches)
            joint = self._norm_rope(joint, scale, self._joint_temperature(slot), cos, sin)
            q, k = joint.split([self.n_heads, hkv], dim=2)
        else:
            q = self._norm_rope(q, scale, None, cos, sin)
            k = self._norm_rope(k, scale, self.temperature, cos, sin)

        # 7. causal GQA attention in the latent space, softmax scale 1/√d
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, n, d]
        out = flexible_attention(qt, kt, vt, causal=True, scale=1.0 / scale)
        if slot is not None:
            self._fill_slot(slot, kt, vt, count, state)

        # 8. output projection
        return self.w_o(out.transpose(1, 2).reshape(b, n, self.q_dim))

    def _norm_rope(self, x, scale: float, temperature, cos, sin) -> torch.Tensor:
        """x [B, n, h, d] QK-normed, then rotated on its first rotary_dim channels."""
        if self.rotary_dim:
            return qk_norm_rope(x, scale, temperature, cos, sin)
        return qk_norm(x, scale, temperature)

    def _decode_step(self, x, cos, sin, slot: CacheSlot, member) -> torch.Tensor:
        """Steps 1–8 for one token per sequence on a filled slot, launch-lean (a graphed step at
        batch 1 is bound by its kernel count): the projection's matmul writes into the slot's
        working row right after the conv state, so the conv window is a view (no cat); steps 4–6
        (value shift, QK norm, RoPE), the cache writes, the attention mask, the conv state's roll
        and the value-shift state are one kernel (cache.decode_attend); then attention and the
        output projection. Everything the step changes is changed in place."""
        entry = slot.entry
        b, n, _ = x.shape
        if n != 1:
            raise ValueError(f"a decode step takes one token per sequence, got x {tuple(x.shape)}")
        c, half, ctx = self.qk_channels, self.kv_dim // 2, self.conv_context
        row = entry.window  # [B, ctx·C + C + kv_dim]
        proj = row[:, ctx * c :]  # this step's [u | x·W_v1 | x·W_v2]
        self._project_into(x.reshape(b, -1), proj)
        window = row[:, : (ctx + 1) * c]  # [B, K·C]: the conv state, then u
        if OPTIONS.decode_conv != "headwise" and not torch.is_grad_enabled():
            q, k = self._conv_qk_window(window, slot)  # [B, n_heads, d], [B, n_kv_heads, d]
        else:
            q, k = self._conv_qk(window.view(b, ctx + 1, c), slot)
            q, k = q[:, 0], k[:, 0]
        scale = math.sqrt(self.head_dim)
        rotary = self.rotary_dim > 0
        out = decode_attend(
            entry, q, k, proj[:, c : c + half], None if member is None else member[:, 0], 1.0 / scale,
            cos=cos if rotary else None, sin=sin if rotary else None, norm_scale=scale,
            k_temperature=self.temperature, v_tail=entry.prev_v, v_tail_next=proj[:, c + half :],
            roll=window if ctx else None, roll_shift=c,
        )  # fmt: skip
        return self.w_o(out.transpose(1, 2).reshape(b, 1, self.q_dim))

    def _project_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` [B, C + kv_dim] (a strided view) ← x [B, E] · W_qkvᵀ: the matmul writes there
        itself where it can (no gradients, no autocast, one dtype), else a copy follows it."""
        weight = self.w_qkv.weight
        direct = x.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(x.device.type)
        if direct and not torch.is_grad_enabled():
            torch.mm(x, weight.t(), out=out)
        else:
            out.copy_(self.w_qkv(x))

    def _state_buffers(self, slot: CacheSlot, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's decode row [B, ctx·C + C + kv_dim] (the conv state, then what each decode
        step's projection writes) and value-shift source [B, kv_dim/2]: a restarted cache's, which
        a captured decode step reads (cache.kept_or_new), else new."""
        old, b = slot.spare, proj.shape[0]
        shape = (b, (self.conv_context + 1) * self.qk_channels + self.kv_dim)
        row = kept_or_new(None if old is None else old.window, shape, proj.dtype, proj.device)
        half = (b, self.kv_dim // 2)
        prev = kept_or_new(None if old is None else old.prev_v, half, proj.dtype, proj.device)
        return row, prev

    def _write_state(self, proj, count, state, views: bool):
        """hydra_kernels' ccgqa_prefill on the projection: the conv window and shifted values
        (``views``) and, with a slot's ``state`` buffers (row, prev), each sequence's conv state
        (its last ctx real inputs, zeros before the first) and value-shift source (its last real
        token's) written into them. Outside torch.compile one launch; inside, its reference."""
        row, prev = (None, None) if state is None else state
        c, ctx = self.qk_channels, self.conv_context
        return ccgqa_prefill(proj, c, ctx, count, views=views, state=state is not None,
                             state_out=None if row is None else row[:, : ctx * c], prev_out=prev)  # fmt: skip

    def _fill_slot(self, slot, kt, vt, count, state) -> None:
        """The slot's cache from the prefill's keys and values and its ``state`` buffers, written
        by :meth:`_write_state`. The row's columns after the conv state are written by each decode
        step's projection before it reads them."""
        row, prev = state
        c, ctx = self.qk_channels, self.conv_context
        entry = prefill_kv(slot, kt, vt, count)
        entry.window, entry.prev_v = row, prev
        entry.conv_state = row[:, : ctx * c].view(row.shape[0], ctx, c)
