"""Triton kernels of CCGQA's folded conv stage (see ``ccgqa_conv`` for what each computes and for
the launchers that run them)."""

import triton
import triton.language as tl

from hydra_kernels.ops._custom_op import dot_operand, to_output_dtype


@triton.jit
def _dot_acc(acc, a, b, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation; IEEE products for fp32 operands (no TF32)."""
    a, b = dot_operand(a), dot_operand(b)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _head_rows(base, rows, stride_wt, head, D: tl.constexpr, mask):
    """[rows, D] of one head's channels, fp32: window rows ``rows`` from ``base`` (a sequence's
    row 0)."""
    ch = tl.arange(0, D)
    return tl.load(base + rows[:, None] * stride_wt + head * D + ch[None, :], mask=mask[:, None],
                   other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _qk_mean_cross(
    acc, base, rows, stride_t, g, N_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, mask,
    TRANSPOSE: tl.constexpr,
):  # fmt: skip
    """acc + head g's q-k mean term from the other heads' rows at ``rows`` (the tokens' own rows;
    ``base`` a sequence's first row, ``stride_t`` a row's stride), fp32 [rows, D]: a query head
    gets its key head's / 2, a key head its query heads' sum / (2G). ``TRANSPOSE`` (read from dz:
    what the window's rows get back) swaps the two weights: its key head's / (2G), each query
    head's / 2. The head's own rows / 2 are the caller's (its last tap's tile). One head's rows
    at a time, in a loop the compiler does not unroll: loading a key head's G query heads at once
    held G more fp32 tiles live beside the accumulator (243 registers a thread, two programs an
    SM; packages/hydra-kernels/BENCHMARKS.md, 2026-11-28)."""
    key_w: tl.constexpr = 0.5 / GROUP if TRANSPOSE else 0.5
    query_w: tl.constexpr = 0.5 if TRANSPOSE else 0.5 / GROUP
    if g < N_Q:
        acc += key_w * _head_rows(base, rows, stride_t, N_Q + g // GROUP, D, mask)
    else:
        j = g - N_Q
        for i in tl.range(0, GROUP):
            acc += query_w * _head_rows(base, rows, stride_t, j * GROUP + i, D, mask)
    return acc


@triton.jit
def _ccgqa_conv_fwd_kernel(
    WIN, W, BIAS, Z,
    n, stride_wb, stride_wt,
    N_HEADS: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
    PAD: tl.constexpr, N_Q: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid_t, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.arange(0, D)
    t_mask = t < n
    seq = WIN + b.to(tl.int64) * stride_wb
    src = seq + g * D
    acc = tl.zeros((BLOCK_T, D), dtype=tl.float32)
    if N_Q > 0:  # the q-k mean's other heads, before the products (fewer registers live)
        own = (t + K - 1 - PAD).to(tl.int64)  # the tokens' own rows: offset K − 1, always stored
        acc = _qk_mean_cross(acc, seq, own, stride_wt, g, N_Q, GROUP, D, t_mask, False)
    for s in tl.static_range(K):
        rows = (t + s - PAD).to(tl.int64)  # PAD leading rows of the window are zeros, not stored
        m = t_mask & (rows >= 0) if PAD > 0 else t_mask
        a = tl.load(src + rows[:, None] * stride_wt + ch[None, :], mask=m[:, None], other=0.0)
        # W[g, s] is [out, in]: read it as [in, out] for a @ w
        w = tl.load(W + (g * K + s) * D * D + ch[None, :] * D + ch[:, None])
        acc = _dot_acc(acc, a, w, IEEE)
        if N_Q > 0 and s == K - 1:  # the q-k mean's own half: the last tap's rows
            acc += 0.5 * a.to(tl.float32)
    acc += tl.load(BIAS + g * D + ch).to(tl.float32)[None, :]
    out = (b.to(tl.int64) * n + t) * N_HEADS + g  # z is [B, n, G, d], contiguous
    z = to_output_dtype(acc, Z.dtype.element_ty)
    tl.store(Z + out[:, None] * D + ch[None, :], z, mask=t_mask[:, None])


@triton.jit
def _ccgqa_conv_dwin_kernel(
    DZ, W, DWIN,
    n,
    N_HEADS: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
    PAD: tl.constexpr, N_Q: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid_r, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r_out = pid_r * BLOCK_T + tl.arange(0, BLOCK_T)  # the stored window's rows
    r = r_out + PAD  # window rows: 0 .. n + K − 2; the PAD zero rows in front get no gradient
    ch = tl.arange(0, D)
    length = n + K - 1 - PAD
    acc = tl.zeros((BLOCK_T, D), dtype=tl.float32)
    if N_Q > 0:  # window row r is token r − K + 1's own row: the q-k mean's transpose
        tok = r - (K - 1)
        m = (tok >= 0) & (tok < n)
        acc = _qk_mean_cross(acc, DZ + b.to(tl.int64) * n * N_HEADS * D, tok.to(tl.int64), N_HEADS * D,
                             g, N_Q, GROUP, D, m, True)  # fmt: skip
    for s in tl.static_range(K):
        rows = r - s  # the output rows that read window row r at offset s
        m = (rows >= 0) & (rows < n)
        src = (b.to(tl.int64) * n + rows) * N_HEADS + g
        a = tl.load(DZ + src[:, None] * D + ch[None, :], mask=m[:, None], other=0.0)
        w = tl.load(W + (g * K + s) * D * D + ch[:, None] * D + ch[None, :])  # [out, in]
        acc = _dot_acc(acc, a, w, IEEE)
        if N_Q > 0 and s == K - 1:  # dz of the token whose own row r is: the mean's own half
            acc += 0.5 * a.to(tl.float32)
    dst = (b.to(tl.int64) * length + r_out) * (N_HEADS * D) + g * D  # dwin is [B, n + K − 1 − PAD, C]
    tl.store(DWIN + dst[:, None] + ch[None, :], to_output_dtype(acc, DWIN.dtype.element_ty),
             mask=(r_out < length)[:, None])  # fmt: skip


@triton.jit
def _ccgqa_conv_dw_kernel(
    DZ, WIN, PW, PB,
    n, n_blocks, blocks_per_seq, stride_wb, stride_wt,
    N_HEADS: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, ITERS: tl.constexpr,
    IEEE: tl.constexpr, PAD: tl.constexpr,
):  # fmt: skip
    g, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ch = tl.arange(0, D)
    acc = tl.zeros((D, D), dtype=tl.float32)  # [out, in]
    acc_b = tl.zeros((D,), dtype=tl.float32)
    for it in tl.range(0, ITERS):  # compile-time trip count (the interpreter needs one)
        blk = split * ITERS + it
        b = (blk // blocks_per_seq).to(tl.int64)
        t = (blk % blocks_per_seq) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = (t < n) & (blk < n_blocks)
        rows = (b * n + t) * N_HEADS + g
        dz = tl.load(DZ + rows[:, None] * D + ch[None, :], mask=t_mask[:, None], other=0.0)
        w_rows = (t + s - PAD).to(tl.int64)  # PAD leading rows of the window are zeros, not stored
        m = t_mask & (w_rows >= 0) if PAD > 0 else t_mask
        a = tl.load(WIN + b * stride_wb + w_rows[:, None] * stride_wt + g * D + ch[None, :],
                    mask=m[:, None], other=0.0)  # fmt: skip
        acc = _dot_acc(acc, tl.trans(dz), a, IEEE)
        acc_b += tl.sum(dz.to(tl.float32), axis=0)
    part = split * N_HEADS + g
    tl.store(PW + ((part * K + s) * D + ch[:, None]) * D + ch[None, :], acc)
    if s == 0:
        tl.store(PB + part * D + ch, acc_b)
