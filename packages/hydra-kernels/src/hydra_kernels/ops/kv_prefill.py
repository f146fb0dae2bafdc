"""A prefill's attention cache written in one kernel: keys, values, the mask and the lengths (no
autograd).

Why: a decoding cache (hydra_model's cache.py) starts from a prompt's full pass: each attention
layer's keys and values copied into the front of [B, H, L, d] buffers whose rest is zeros, the
per-sequence count of real tokens, and an additive mask over the L positions (0 for held keys,
−inf beyond). Op by op that is three fills, two copies, a count, an arange, a compare and a masked
fill: nine launches a layer at batch 1, where a prefill is bound by its host launches. Here it is
one. The dense GPT and HYDRA both fill their caches this way.

For k, v [B, H, n, d] and ``count`` [B] (the real tokens at the front of each sequence; all n when
None), with capacity L ≥ n:

    k_cache[b, h, s] = k[b, h, s] if s < n else 0        (v_cache alike)
    length[b]        = count[b]
    bias[b, s]       = 0 if s < length[b] else −inf

Faces: the PyTorch reference :func:`kv_prefill_ref_` (the op-by-op form, in place), the Triton
kernel ``_kv_prefill_kernel`` (a block of positions of one (sequence, head) a program; the
programs of head 0 also write the mask and the length) with its launcher
:func:`kv_prefill_launch`, and :func:`kv_prefill_`, which runs the kernel where hydra_kernels'
Triton path is on for k's device (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the
reference elsewhere. Copies and constants: both give the same bits. Nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    cdiv,
    check_devices,
    compiling,
    device_guard,
    next_power_of_2,
    run_with_fallback,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Elements of one of k and v a program copies at most (its positions × the padded head width).
MAX_TILE = 4096


# --- PyTorch reference ---------------------------------------------------------------------------


def kv_prefill_ref_(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    bias: torch.Tensor, length: torch.Tensor, count: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The cache op by op (see the module docstring), written into the given tensors."""
    b, _, n, _ = k.shape
    length.copy_(torch.full((b,), n, dtype=torch.long, device=k.device) if count is None else count)
    k_cache.zero_()
    v_cache.zero_()
    k_cache[:, :, :n] = k
    v_cache[:, :, :n] = v
    keys = torch.arange(bias.shape[1], device=bias.device)
    bias.zero_().masked_fill_(keys.view(1, -1) >= length.view(-1, 1), float("-inf"))


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _kv_prefill_kernel(
    K, V, KC, VC, BIAS, LEN, COUNT, n, capacity, heads,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_COUNT: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # sequence · heads + head
    sb = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    col = tl.arange(0, BLOCK_D)
    in_cache = s < capacity
    held = s < n
    load = held[:, None] & (col < D)[None, :]
    store = in_cache[:, None] & (col < D)[None, :]
    dst = (bh * capacity + s[:, None]) * D + col[None, :]
    src_k = K + b * stride_kb + h * stride_kh + s[:, None] * stride_kn + col[None, :]
    tl.store(KC + dst, tl.load(src_k, mask=load, other=0.0), mask=store)
    src_v = V + b * stride_vb + h * stride_vh + s[:, None] * stride_vn + col[None, :]
    tl.store(VC + dst, tl.load(src_v, mask=load, other=0.0), mask=store)
    if h == 0:  # the sequence's mask over these positions, and (first block) its length
        real = tl.load(COUNT + b).to(tl.int64) if HAS_COUNT else n  # n: an int (1 may be a constant)
        zero = tl.zeros((BLOCK_S,), dtype=tl.float32)
        mask = tl.where(s < real, zero, zero - float("inf"))
        tl.store(BIAS + b * capacity + s, mask.to(BIAS.dtype.element_ty), mask=in_cache)
        if sb == 0:
            tl.store(LEN + b, real)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def kv_prefill_launch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    bias: torch.Tensor, length: torch.Tensor, count: torch.Tensor | None,
) -> None:  # fmt: skip
    """Launch the kernel (arguments checked by :func:`kv_prefill_`): k and v with unit stride
    along d; the caches, bias, length and count contiguous."""
    b, heads, n, d = k.shape
    capacity = k_cache.shape[2]
    if b * heads == 0 or capacity == 0:
        return
    block_d = next_power_of_2(d)
    block_s = max(1, min(MAX_TILE // block_d, next_power_of_2(capacity)))
    ks, vs = k.stride(), v.stride()
    key = (b, heads, n, d, capacity, ks, vs, k.dtype, v.dtype, bias.dtype,
           None if count is None else count.dtype, k.get_device())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        consts = {"D": d, "BLOCK_D": block_d, "BLOCK_S": block_s, "HAS_COUNT": count is not None}
        grid = (b * heads, cdiv(capacity, block_s))
        plan = _PLANS[key] = LaunchPlan(_kv_prefill_kernel, grid, consts, 4, 1, k.get_device())
    with device_guard(k):
        plan(k, v, k_cache, v_cache, bias, length, length if count is None else count, n, capacity, heads,
             ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])  # fmt: skip


# --- public function -----------------------------------------------------------------------------


def kv_prefill_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bias: torch.Tensor,
    length: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """Write a prefill's cache (see the module docstring): k, v [B, H, n, d] (any strides);
    k_cache, v_cache [B, H, L, d] of k's and v's dtypes, bias [B, L] of k's dtype, length [B]
    long, all contiguous, L ≥ n; ``count`` [B] integers in [0, n] or None (all n). The Triton
    kernel runs where hydra_kernels' Triton path is on for k's device; a switched-off path or
    another device run :func:`kv_prefill_ref_`. No autograd."""
    if k.dim() != 4:  # unpacked below: a ValueError naming k, not Python's unpacking error
        raise ValueError(f"kv_prefill_: k must be [B, H, n, d], got k {tuple(k.shape)} {k.dtype}")
    b, heads, n, d = k.shape
    capacity = k_cache.shape[2] if k_cache.dim() == 4 else -1
    bad = (
        v.shape != k.shape or k_cache.shape != (b, heads, capacity, d) or v_cache.shape != k_cache.shape
        or capacity < n or bias.shape != (b, capacity) or length.shape != (b,) or length.dtype != torch.long
        or k_cache.dtype != k.dtype or v_cache.dtype != v.dtype or bias.dtype != k.dtype
        or (count is not None and (count.shape != (b,) or count.is_floating_point()))
    )  # fmt: skip
    if bad:
        raise ValueError(
            f"kv_prefill_: k, v [B, H, n, d], caches [B, H, L ≥ n, d] of their dtypes, bias [B, L] of "
            f"k's dtype, length [B] long, count [B] integers or None; got k {tuple(k.shape)} {k.dtype}, "
            f"v {tuple(v.shape)}, caches {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} "
            f"{v_cache.dtype}, bias {tuple(bias.shape)} {bias.dtype}, length {tuple(length.shape)} "
            f"{length.dtype}, count {None if count is None else (tuple(count.shape), count.dtype)}"
        )
    names = "k v k_cache v_cache bias length count"
    check_devices("kv_prefill_", names, k, v, k_cache, v_cache, bias, length, count)
    outputs = (k_cache, v_cache, bias, length)
    # inside torch.compile the reference (a raw launch would break the graph)
    kernel = not compiling() and controls.triton_path("kv_prefill", k, v)
    kernel = kernel and all(t.is_contiguous() for t in outputs)
    if not kernel:
        kv_prefill_ref_(k, v, k_cache, v_cache, bias, length, count)
        return
    if d and k.stride(3) != 1:
        k = k.contiguous()
    if d and v.stride(3) != 1:
        v = v.contiguous()
    if count is not None:
        count = count.contiguous()
    run_with_fallback(
        "kv_prefill",
        lambda: kv_prefill_launch(k, v, k_cache, v_cache, bias, length, count),
        lambda: kv_prefill_ref_(k, v, k_cache, v_cache, bias, length, count),
    )
