"""One decoded token's attention inputs and cache update in one kernel.

Why: at batch 1 a graphed decode step is bound by how many kernels it launches (~4 µs each on an
H100). Done op by op, the work between a decoding attention layer's projection and its attention
is a dozen tiny kernels: the QK norm of q and of k, RoPE of q and of k, a scatter of the new key
and one of the new value into the cache, the mask of the held keys (arange, compare, and SDPA's
own boolean → additive conversion), the length's advance, and in CCGQA the value cat, the
conv-window roll (cat + copy) and the value-shift copy. Here it is one launch.

For each sequence b (one program each; nothing crosses rows), with ``pos = length[b]`` and every
statistic in fp32:

    q_out[b]           = rope(qk_norm(q[b]))                  (qk_norm only with ``norm_scale``,
    k_cache[b, :, pos] = rope(qk_norm(k[b], temperature))      rope only with ``cos``/``sin``)
    v_cache[b, :, pos] = cat(v[b], v_tail[b])                 (flat [n_kv·d], head-major)
    bias[b, pos]       = 0                                    (additive mask: the key is attended)
    where write[b]:  v_tail[b] ← v_tail_next[b];  roll[b, :W−s] ← roll[b, s:W]  (s = roll_shift)
    length[b]         += write[b]                             (1 when ``write`` is None)

The new key is written at ``length[b]`` whether or not the token joins the cache (a token that
does not join still attends to itself; the next token's write overwrites it), which is the
contract of hydra_model's decoding cache (hydra_model/cache.py). ``bias`` is that cache's additive
attention mask: 0 for held keys and the current position, −inf beyond; keeping it in the cache
(this kernel opens one position per step) replaces the per-step mask build. Intermediate roundings
are those of the unfused ops: the QK norm's output is rounded to q's (k's) dtype before RoPE reads
it, RoPE's output to q's (k's) dtype, then k to the cache's dtype.

Faces: the PyTorch reference :func:`kv_decode_step_ref` (the op-by-op computation: hydra_kernels'
qk_norm and rope references, scatters, copies), the Triton kernel ``_kv_decode_kernel`` with its
launcher :func:`kv_decode_step_launch`, and :func:`kv_decode_step`, which runs the kernel where
hydra_kernels' Triton path is on for the tensors' device (CUDA, or the CPU under
``TRITON_INTERPRET=1``) and nothing needs a gradient, and the reference elsewhere. Nothing is read
on the host and the only allocation is ``q_out`` (fixed shape), so a call can be captured in a
CUDA graph after one eager call compiled the kernel. A position past the cache's capacity is not
written by the kernel (the reference's scatter raises): callers size the cache for the generation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    check_devices,
    device_guard,
    next_power_of_2,
    run_with_fallback,
    to_output_dtype,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache
from hydra_kernels.ops.qk_norm import NORM_EPS, qk_norm_ref
from hydra_kernels.ops.rope import rope_ref

#: Largest [heads × head_dim] tile one loop iteration holds (fp32 values per program).
MAX_TILE = 4096
#: Widest chunk of the value and of the rolled state one loop iteration moves.
MAX_BLOCK = 2048


# --- PyTorch reference ---------------------------------------------------------------------------


def _table(t: torch.Tensor) -> torch.Tensor:
    """[B, R/2] → [B, 1, R/2] (per-sequence rows), [R/2] → [1, R/2] (shared): rope_ref's layouts."""
    return t.unsqueeze(1) if t.dim() == 2 else t.unsqueeze(0)


def kv_decode_step_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    bias: torch.Tensor,
    write: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    norm_scale: float | None = None,
    k_temperature: torch.Tensor | None = None,
    v_tail: torch.Tensor | None = None,
    v_tail_next: torch.Tensor | None = None,
    roll: torch.Tensor | None = None,
    roll_shift: int = 0,
) -> torch.Tensor:
    """The step op by op (see the module docstring; arguments as :func:`kv_decode_step`).
    Differentiable in q and k (what a decode step with gradients on needs); fp64 stays fp64."""
    b, hkv, _, d = k_cache.shape
    if norm_scale is not None:
        q = qk_norm_ref(q, norm_scale, None)
        k = qk_norm_ref(k, norm_scale, k_temperature)
    if cos is not None:
        cos, sin = _table(cos), _table(sin)
        q = rope_ref(q.unsqueeze(1), cos, sin).squeeze(1)
        k = rope_ref(k.unsqueeze(1), cos, sin).squeeze(1)
    values = v if v_tail is None else torch.cat([v, v_tail.to(v.dtype)], dim=-1)
    pos = length.view(b, 1, 1, 1).expand(b, hkv, 1, d)
    k_cache.scatter_(2, pos, k.to(k_cache.dtype).unsqueeze(2))
    v_cache.scatter_(2, pos, values.reshape(b, hkv, 1, d).to(v_cache.dtype))
    bias.scatter_(1, length.view(b, 1), 0.0)
    keep = None if write is None else write.view(b, 1)
    if v_tail_next is not None:
        new = v_tail_next.to(v_tail.dtype)
        v_tail.copy_(new if keep is None else torch.where(keep, new, v_tail))
    if roll is not None and roll.shape[1] > roll_shift:
        kept = roll.shape[1] - roll_shift
        moved = roll[:, roll_shift:].clone()  # the source overlaps the destination
        roll[:, :kept].copy_(moved if keep is None else torch.where(keep, moved, roll[:, :kept]))
    length.add_(1 if write is None else write.to(length.dtype))
    return q.contiguous()


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _norm_rope_tile(
    X, stride_h, h0, TEMP, COS, SIN, scale, eps_sq,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_TEMP: tl.constexpr, MID: tl.constexpr,
):  # fmt: skip
    """Heads h0 .. h0+BLOCK_H−1 of one token, QK-normed (``NORM``) and rotated (``HALF`` > 0) as
    hydra_kernels' qk_norm then rope kernels compute them, the norm's output rounded to ``MID``.
    Returns (fp32 tile [BLOCK_H, BLOCK_D], head indices, column indices, mask)."""
    heads = h0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < N_HEADS)[:, None] & (cols < HEAD_DIM)[None, :]
    rows = heads.to(tl.int64)[:, None] * stride_h
    x = tl.load(X + rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HALF > 0:  # each rotated column's partner in the rotate-half layout
        partner = tl.where(cols < HALF, cols + HALF, tl.where(cols < 2 * HALF, cols - HALF, cols))
        xp = tl.load(X + rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        gain = tl.rsqrt(tl.maximum(tl.sum(x * x, axis=1), eps_sq)) * scale
        if HAS_TEMP:
            gain *= tl.exp(tl.load(TEMP + heads, mask=heads < N_HEADS, other=0.0).to(tl.float32))
        x = to_output_dtype(x * gain[:, None], MID).to(tl.float32)
        if HALF > 0:
            xp = to_output_dtype(xp * gain[:, None], MID).to(tl.float32)
    if HALF > 0:
        rotated = cols < 2 * HALF
        t = tl.where(cols < HALF, cols, cols - HALF)
        c = tl.load(COS + t, mask=rotated, other=0.0).to(tl.float32)[None, :]
        s = tl.load(SIN + t, mask=rotated, other=0.0).to(tl.float32)[None, :]
        first = (cols < HALF)[None, :]
        x = tl.where(first, x * c - xp * s, tl.where(rotated[None, :], x * c + xp * s, x))
    return x, heads, cols, mask


@triton.jit
def _kv_decode_kernel(
    Q, K, V, V_TAIL, V_NEXT, COS, SIN, TEMP, K_CACHE, V_CACHE, LENGTH, BIAS, WRITE, Q_OUT, ROLL,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_tailb, stride_nextb, stride_tb,
    stride_cb, stride_ch, stride_cl, stride_len, stride_biasb, stride_write, stride_rollb,
    cache_len, scale, eps_sq,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    HAS_TEMP: tl.constexpr, V_SPLIT: tl.constexpr, BLOCK_V: tl.constexpr, HAS_TAIL: tl.constexpr,
    HAS_NEXT: tl.constexpr, HAS_WRITE: tl.constexpr, ROLL_KEEP: tl.constexpr, ROLL_SHIFT: tl.constexpr,
    BLOCK_ROLL: tl.constexpr,
):  # fmt: skip
    # One program per sequence: the length it reads is the one it advances, so no other program
    # can see it half-updated. Barriers order every thread's reads of state before any thread's
    # writes of it (warps run independently).
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(LENGTH + b * stride_len)
    fits = pos < cache_len
    if HAS_WRITE:  # noqa: SIM108 (a constexpr branch, not a run-time choice)
        joins = tl.load(WRITE + b * stride_write) != 0
    else:
        joins = pos == pos  # True
    cos_row = COS + b * stride_tb
    sin_row = SIN + b * stride_tb
    slot = b * stride_cb + pos * stride_cl  # [b, ·, pos, ·] of the caches
    for h0 in tl.static_range(0, HQ, BLOCK_HQ):
        y, heads, cols, mask = _norm_rope_tile(
            Q + b * stride_qb, stride_qh, h0, TEMP, cos_row, sin_row, scale, eps_sq,
            HQ, HEAD_DIM, BLOCK_HQ, BLOCK_D, HALF, NORM, False, Q.dtype.element_ty,
        )  # fmt: skip
        out = Q_OUT + b * (HQ * HEAD_DIM) + heads.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :]
        tl.store(out, to_output_dtype(y, Q_OUT.dtype.element_ty), mask=mask)
    for h0 in tl.static_range(0, HKV, BLOCK_HKV):
        y, heads, cols, mask = _norm_rope_tile(
            K + b * stride_kb, stride_kh, h0, TEMP, cos_row, sin_row, scale, eps_sq,
            HKV, HEAD_DIM, BLOCK_HKV, BLOCK_D, HALF, NORM, HAS_TEMP, K.dtype.element_ty,
        )  # fmt: skip
        y = to_output_dtype(y, K.dtype.element_ty).to(tl.float32)  # k's dtype, then the cache's
        dst = K_CACHE + slot + heads.to(tl.int64)[:, None] * stride_ch + cols[None, :]
        tl.store(dst, to_output_dtype(y, K_CACHE.dtype.element_ty), mask=mask & fits)
    for j0 in tl.static_range(0, HKV * HEAD_DIM, BLOCK_V):
        j = j0 + tl.arange(0, BLOCK_V)
        ok = j < HKV * HEAD_DIM
        lo = j < V_SPLIT
        val = tl.load(V + b * stride_vb + j, mask=ok & lo, other=0.0).to(tl.float32)
        if HAS_TAIL:
            tail = tl.load(V_TAIL + b * stride_tailb + (j - V_SPLIT), mask=ok & (j >= V_SPLIT), other=0.0)
            val = tl.where(lo, val, tail.to(V.dtype.element_ty).to(tl.float32))
        dst = V_CACHE + slot + (j // HEAD_DIM).to(tl.int64) * stride_ch + j % HEAD_DIM
        tl.store(dst, to_output_dtype(val, V_CACHE.dtype.element_ty), mask=ok & fits)
    tl.store(BIAS + b * stride_biasb + pos, tl.zeros((), dtype=BIAS.dtype.element_ty), mask=fits)
    tl.debug_barrier()  # every thread has read pos and v_tail
    if HAS_NEXT:
        for j0 in tl.static_range(V_SPLIT, HKV * HEAD_DIM, BLOCK_V):
            j = j0 + tl.arange(0, BLOCK_V) - V_SPLIT
            ok = (j < HKV * HEAD_DIM - V_SPLIT) & joins
            new = tl.load(V_NEXT + b * stride_nextb + j, mask=ok, other=0.0).to(tl.float32)
            tl.store(V_TAIL + b * stride_tailb + j, to_output_dtype(new, V_TAIL.dtype.element_ty), mask=ok)
    if ROLL_KEEP > 0:
        # chunks in ascending order, each no wider than the shift: a chunk's source lies past every
        # destination written before it
        for r0 in tl.static_range(0, ROLL_KEEP, BLOCK_ROLL):
            r = r0 + tl.arange(0, BLOCK_ROLL)
            ok = (r < ROLL_KEEP) & joins
            moved = tl.load(ROLL + b * stride_rollb + ROLL_SHIFT + r, mask=ok, other=0.0)
            tl.debug_barrier()
            tl.store(ROLL + b * stride_rollb + r, moved, mask=ok)
    tl.store(LENGTH + b * stride_len, pos + joins.to(pos.dtype))


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def _check(q, k, v, k_cache, v_cache, length, bias, write, cos, sin, k_temperature, v_tail, v_tail_next, roll,
           roll_shift) -> None:  # fmt: skip
    """Shapes and dtypes every path relies on; raises ValueError (a caller's mistake)."""
    if q.dim() != 3 or k.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"kv_decode_step: q [B, Hq, D], k [B, Hkv, D] and the caches [B, Hkv, L, D] expected; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    b, hkv, cache_len, d = k_cache.shape
    if k.shape != (b, hkv, d) or q.shape[0] != b or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(
            f"kv_decode_step: q {tuple(q.shape)} and k {tuple(k.shape)} do not fit the cache "
            f"{tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("kv_decode_step: k_cache and v_cache must have the same shape and strides")
    tail = 0 if v_tail is None else v_tail.shape[-1]
    if v.dim() != 2 or v.shape[0] != b or v.shape[1] + tail != hkv * d:
        raise ValueError(
            f"kv_decode_step: v [B, V1] and v_tail [B, n_kv·d − V1] must hold n_kv·d = {hkv * d} values "
            f"per row; got v {tuple(v.shape)}, v_tail {None if v_tail is None else tuple(v_tail.shape)}"
        )
    if v_tail_next is not None and (v_tail is None or v_tail_next.shape != v_tail.shape):
        raise ValueError("kv_decode_step: v_tail_next needs a v_tail of its shape")
    if length.shape != (b,) or length.dtype != torch.long:
        raise ValueError(
            f"kv_decode_step: length must be [B] int64, got {tuple(length.shape)}, {length.dtype}"
        )
    if bias.shape != (b, cache_len) or not bias.is_floating_point():
        raise ValueError(
            f"kv_decode_step: bias must be a float [{b}, {cache_len}] (B, L), got {tuple(bias.shape)}"
        )
    if write is not None and (write.shape != (b,) or write.dtype != torch.bool):
        raise ValueError(f"kv_decode_step: write must be [B] bool, got {tuple(write.shape)} {write.dtype}")
    if (cos is None) != (sin is None):
        raise ValueError("kv_decode_step: pass both cos and sin, or neither")
    if cos is not None and (
        cos.shape != sin.shape or cos.dim() not in (1, 2) or (cos.dim() == 2 and cos.shape[0] != b)
        or 2 * cos.shape[-1] > d
    ):  # fmt: skip
        raise ValueError(
            f"kv_decode_step: cos/sin must be [B, R/2] or [R/2] with R ≤ D = {d}; got {tuple(cos.shape)}"
        )
    if k_temperature is not None and k_temperature.shape != (hkv,):
        raise ValueError(f"kv_decode_step: k_temperature must be [{hkv}], got {tuple(k_temperature.shape)}")
    if roll is not None and (roll.dim() != 2 or roll.shape[0] != b or roll_shift <= 0):
        raise ValueError(f"kv_decode_step: roll must be [B, W] with roll_shift > 0, got {tuple(roll.shape)}")
    check_devices("kv_decode_step", "q k v k_cache v_cache length bias write cos sin k_temperature v_tail "
                  "v_tail_next roll", q, k, v, k_cache, v_cache, length, bias, write, cos, sin, k_temperature,
                  v_tail, v_tail_next, roll)  # fmt: skip


def kv_decode_step_launch(
    q, k, v, k_cache, v_cache, length, bias, write, cos, sin, norm_scale, k_temperature, v_tail, v_tail_next,
    roll, roll_shift,
) -> torch.Tensor:  # fmt: skip
    """Launch the kernel (arguments as :func:`kv_decode_step`). Rows may be strided, but every
    innermost dimension must be contiguous: copying here would allocate inside a captured graph."""
    b, hkv, cache_len, d = k_cache.shape
    hq = q.shape[1]
    inner = [q, k, v, k_cache, bias, cos, sin, v_tail, v_tail_next, roll]
    if any(t is not None and t.stride(-1) != 1 for t in inner) or (
        cos is not None and cos.stride() != sin.stride()
    ):
        raise ValueError("kv_decode_step: innermost dimensions must have unit stride (cos and sin alike)")
    if k_temperature is not None and not k_temperature.is_contiguous():
        raise ValueError("kv_decode_step: k_temperature must be contiguous")
    q_out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return q_out
    half = 0 if cos is None else cos.shape[-1]
    stride_tb = 0 if cos is None or cos.dim() == 1 else cos.stride(0)
    tail = 0 if v_tail is None else v_tail.shape[1]
    keep = 0 if roll is None else max(0, roll.shape[1] - roll_shift)
    strides = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        0 if v_tail is None else v_tail.stride(0), 0 if v_tail_next is None else v_tail_next.stride(0),
        stride_tb, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), length.stride(0), bias.stride(0),
        0 if write is None else write.stride(0), 0 if roll is None else roll.stride(0),
    )  # fmt: skip
    flags = (norm_scale is not None, k_temperature is not None, write is not None, v_tail_next is not None)
    dtypes = tuple(None if t is None else t.dtype for t in (q, k, v, v_tail, v_tail_next, cos, k_temperature,
                                                             k_cache, bias, roll))  # fmt: skip
    key = (b, hq, hkv, cache_len, d, half, tail, keep, roll_shift, strides, flags, dtypes, q.get_device())
    plan = _PLANS.get(key)
    if plan is None:
        block_d = next_power_of_2(d)
        rows = max(1, MAX_TILE // block_d)
        v_block = min(next_power_of_2(hkv * d), MAX_BLOCK)
        roll_block = 1
        if keep:  # a power of two no wider than the shift (see the kernel), nor than MAX_BLOCK
            roll_block = min(1 << (roll_shift.bit_length() - 1), MAX_BLOCK, next_power_of_2(keep))
        consts = {
            "HQ": hq, "HKV": hkv, "HEAD_DIM": d, "BLOCK_HQ": min(next_power_of_2(hq), rows),
            "BLOCK_HKV": min(next_power_of_2(hkv), rows), "BLOCK_D": block_d, "HALF": half,
            "NORM": norm_scale is not None, "HAS_TEMP": k_temperature is not None, "V_SPLIT": hkv * d - tail,
            "BLOCK_V": v_block, "HAS_TAIL": v_tail is not None, "HAS_NEXT": v_tail_next is not None,
            "HAS_WRITE": write is not None, "ROLL_KEEP": keep, "ROLL_SHIFT": roll_shift,
            "BLOCK_ROLL": roll_block,
        }  # fmt: skip
        plan = _PLANS[key] = LaunchPlan(_kv_decode_kernel, (b,), consts, 4, 1, q.get_device())
    dummy = q  # stands in for absent pointers (never read: their flags are off)
    with device_guard(q):
        plan(
            q, k, v, dummy if v_tail is None else v_tail, dummy if v_tail_next is None else v_tail_next,
            dummy if cos is None else cos, dummy if sin is None else sin,
            dummy if k_temperature is None else k_temperature, k_cache, v_cache, length, bias,
            dummy if write is None else write, q_out, dummy if roll is None else roll, *strides, cache_len,
            float(1.0 if norm_scale is None else norm_scale), NORM_EPS * NORM_EPS,
        )  # fmt: skip
    return q_out


# --- public function -----------------------------------------------------------------------------


def kv_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    bias: torch.Tensor,
    *,
    write: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    norm_scale: float | None = None,
    k_temperature: torch.Tensor | None = None,
    v_tail: torch.Tensor | None = None,
    v_tail_next: torch.Tensor | None = None,
    roll: torch.Tensor | None = None,
    roll_shift: int = 0,
) -> torch.Tensor:
    """One decoded token's queries → ``q_out`` [B, Hq, D] (contiguous, q's dtype), with its key and
    value written into the cache and the cache's state advanced in place (see the module
    docstring).

    q [B, Hq, D], k [B, Hkv, D] (pre-norm, pre-RoPE; any row and head strides); v [B, V1] the first
    V1 of the token's n_kv·D values and ``v_tail`` [B, n_kv·D − V1] the rest (None when V1 covers
    them), ``v_tail_next`` [B, n_kv·D − V1] what replaces ``v_tail`` where the token joins;
    k_cache, v_cache [B, Hkv, L, D]; length [B] int64; bias [B, L] float additive mask; write [B]
    bool (None: every token joins); cos/sin [B, R/2] or [R/2] (None: no RoPE); ``norm_scale``
    (None: no QK norm) and ``k_temperature`` [Hkv] (keys' exp gain); ``roll`` [B, W]: where the
    token joins, ``roll[:, :W − roll_shift] ← roll[:, roll_shift:]``. Innermost dimensions must be
    contiguous for the kernel. Inputs may live in one buffer (a projection row and ``roll``, as
    CCGQA's decode step keeps them) but must not overlap anything the step writes: the caches,
    ``bias``, ``length``, ``v_tail`` and ``roll``'s first W − ``roll_shift`` columns.
    """
    _check(q, k, v, k_cache, v_cache, length, bias, write, cos, sin, k_temperature, v_tail, v_tail_next, roll,
           roll_shift)  # fmt: skip
    args = (q, k, v, k_cache, v_cache, length, bias, write, cos, sin, norm_scale, k_temperature, v_tail,
            v_tail_next, roll, roll_shift)  # fmt: skip
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, v_tail, k_temperature, cos, sin)
    )
    floats = [t for t in (q, k, v, k_cache, v_cache, bias, v_tail, roll) if t is not None]
    use_kernel = (
        not grads
        and all(t.dtype in KERNEL_DTYPES for t in floats)
        and controls.triton_path("kv_decode_step", q)
    )
    if not use_kernel:
        return kv_decode_step_ref(*args)
    # a launch fails before the kernel runs (compilation, argument binding), so the cache is still
    # untouched and the reference can step instead (counted: controls.fallback_counts())
    return run_with_fallback(
        "kv_decode_step", lambda: kv_decode_step_launch(*args), lambda: kv_decode_step_ref(*args)
    )
