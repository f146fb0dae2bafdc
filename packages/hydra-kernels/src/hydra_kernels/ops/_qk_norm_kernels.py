"""Triton kernels of the per-head QK norm, forward and backward, with RoPE fused in when
``HALF`` > 0 (see ``qk_norm`` for what each computes and for the launchers that run them, and
``qk_norm_rope`` for the fused op).

Separate from ``ops/qk_norm.py`` so that the op's module holds its references, launchers, custom
ops and public function, as ``ops/_rms_norm_kernels.py`` and ``ops/_ccgqa_conv_kernels.py`` do
for theirs.
"""

import triton
import triton.language as tl

from hydra_kernels.ops._custom_op import to_output_dtype
from hydra_kernels.ops.rope import rope_operands, rotate_half


@triton.jit
def _qk_norm_fwd_kernel(
    X, TEMP, COS, SIN, Y,
    n_rows, stride_t, stride_h, seq_len, stride_tb, stride_ts, scale, eps_sq,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_TEMP: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # row = token · H + head
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < HEAD_DIM)[None, :]
    head = rows % N_HEADS
    token = rows // N_HEADS
    src = token.to(tl.int64) * stride_t + head * stride_h  # offsets can pass 2**31
    rows = rows.to(tl.int64)
    x = tl.load(X + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gain = tl.rsqrt(tl.maximum(tl.sum(x * x, axis=1), eps_sq)) * scale
    if HAS_TEMP:
        gain *= tl.exp(tl.load(TEMP + head, mask=row_mask, other=0.0).to(tl.float32))
    y = x * gain[:, None]
    if HALF > 0:  # RoPE on the normed head, which is rounded to Y's dtype first as qk_norm's output is
        partner, c, s, first, rotated = rope_operands(
            COS, SIN, token, seq_len, stride_tb, stride_ts, row_mask, cols, HALF
        )
        xp = tl.load(X + src[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        y = to_output_dtype(y, Y.dtype.element_ty).to(tl.float32)
        yp = to_output_dtype(xp * gain[:, None], Y.dtype.element_ty).to(tl.float32)
        y = rotate_half(y, yp, c, s, first, rotated)
    tl.store(Y + rows[:, None] * HEAD_DIM + cols[None, :], to_output_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_bwd_kernel(
    DY, X, TEMP, COS, SIN, DX, DT_PARTIAL,
    n_rows, stride_dyt, stride_dyh, stride_xt, stride_xh, seq_len, stride_tb, stride_ts, scale, eps_sq,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, ITERS: tl.constexpr, HAS_TEMP: tl.constexpr, LOOP_STAGES: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < HEAD_DIM
    heads = tl.arange(0, BLOCK_H)
    dt_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # compile-time trip count (see persistent_grid); named stages make Triton prefetch row blocks
    for it in tl.range(0, ITERS, num_stages=LOOP_STAGES):
        rows = (pid * ITERS + it) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        head = rows % N_HEADS
        token = (rows // N_HEADS).to(tl.int64)
        rows = rows.to(tl.int64)
        x_src = token * stride_xt + head * stride_xh
        dy_src = token * stride_dyt + head * stride_dyh
        x = tl.load(X + x_src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + dy_src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HALF > 0:  # the gradient rotated back first, rounded to DY's dtype as rope's backward rounds it
            partner, c, s, first, rotated = rope_operands(
                COS, SIN, token, seq_len, stride_tb, stride_ts, row_mask, cols, HALF
            )
            dyp = tl.load(DY + dy_src[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = rotate_half(dy, dyp, c, -s, first, rotated)
            dy = to_output_dtype(dy, DY.dtype.element_ty).to(tl.float32)
        sq = tl.sum(x * x, axis=1)
        inv = tl.rsqrt(tl.maximum(sq, eps_sq))
        gain = inv * scale
        if HAS_TEMP:
            gain *= tl.exp(tl.load(TEMP + head, mask=row_mask, other=0.0).to(tl.float32))
        dot = tl.sum(dy * x, axis=1)
        radial = tl.where(sq >= eps_sq, inv * inv * dot, 0.0)
        dx = gain[:, None] * (dy - x * radial[:, None])
        tl.store(
            DX + rows[:, None] * HEAD_DIM + cols[None, :], to_output_dtype(dx, DX.dtype.element_ty), mask=mask
        )
        if HAS_TEMP:
            row_dt = tl.where(row_mask, gain * dot, 0.0)  # Σ_d dy·y of each row
            hit = head[:, None] == heads[None, :]
            dt_acc += tl.sum(tl.where(hit, row_dt[:, None], 0.0), axis=0)
    if HAS_TEMP:
        tl.store(DT_PARTIAL + pid * N_HEADS + heads, dt_acc, mask=heads < N_HEADS)
