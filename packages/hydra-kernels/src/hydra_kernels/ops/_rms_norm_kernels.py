"""Triton kernels of RMSNorm and its residual-add variant (see ``rms_norm`` for what each does and
for the launchers that run them)."""

import triton
import triton.language as tl

from hydra_kernels.ops._custom_op import to_output_dtype


@triton.jit
def _rms_norm_fwd_kernel(
    X, RES, W, Y, SUM,
    n_rows, stride_x, stride_res, eps,
    N_COLS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < N_COLS)[None, :]
    rows = rows.to(tl.int64)  # row offsets can pass 2**31 elements
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out_offs = rows[:, None] * N_COLS + cols[None, :]
    if HAS_RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        summed = to_output_dtype(x + res.to(tl.float32), SUM.dtype.element_ty)
        tl.store(SUM + out_offs, summed, mask=mask)
        x = summed.to(tl.float32)
    w = tl.load(W + cols, mask=cols < N_COLS, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N_COLS + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + out_offs, to_output_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, DSUM, DX, DRES, DW_PARTIAL,
    n_rows, stride_dy, stride_x, stride_dsum, eps,
    N_COLS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, ITERS: tl.constexpr,
    HAS_DSUM: tl.constexpr, HAS_DRES: tl.constexpr, LOOP_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < N_COLS
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=tl.float32)
    # ITERS is a compile-time trip count (a power of two picked by the launcher): the Triton
    # interpreter cannot loop to a run-time bound, and few distinct values keep compiles few.
    # Naming the stages here makes Triton prefetch later row blocks into shared memory (cp.async);
    # without it the loads are not pipelined and only occupancy hides their latency.
    for it in tl.range(0, ITERS, num_stages=LOOP_STAGES):
        rows = (pid * ITERS + it) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DSUM:  # issued with the other loads, before the row statistics wait on x
            ds = tl.load(DSUM + rows[:, None] * stride_dsum + cols[None, :], mask=mask, other=0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N_COLS + eps)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        proj = tl.sum(xhat * g, axis=1) / N_COLS
        dx = (g - xhat * proj[:, None]) * rstd[:, None]
        if HAS_DSUM:
            dx += ds.to(tl.float32)
        out_offs = rows[:, None] * N_COLS + cols[None, :]
        dx_out = to_output_dtype(dx, DX.dtype.element_ty)
        tl.store(DX + out_offs, dx_out, mask=mask)
        if HAS_DRES:  # a second, unaliased copy for the residual's gradient (see the launcher)
            tl.store(DRES + out_offs, dx_out, mask=mask)
        dw_acc += dy * xhat
    tl.store(DW_PARTIAL + pid * N_COLS + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _dw_reduce_kernel(
    PARTIAL, DW, n_partials,
    N_COLS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, P_ITERS: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N_COLS
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for it in tl.range(0, P_ITERS):
        parts = it * BLOCK_P + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + parts[:, None] * N_COLS + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, to_output_dtype(tl.sum(acc, axis=0), DW.dtype.element_ty), mask=col_mask)
