"""Triton kernels of ``linear_cross_entropy`` and their host launchers.

The matmuls of the op (logits = h·Wᵀ, dh = dlogits·W) go to cuBLAS through ``torch.mm``; what
lives here is the part cuBLAS cannot do:

- ``_ce_rows_kernel``: over one chunk of logits ``[rows, V]``, per row: log-sum-exp in fp32 (an
  online max/sum pass over vocabulary blocks), the loss ``lse − x[target] + z·lse²``, and, when
  asked, the gradient w.r.t. the logits written back over them in place (a second pass):
  ``(softmax·(1 + 2z·lse) − onehot) · scale``. The grid is persistent (a few programs per SM,
  each walking its rows), so few rows are in flight and a row read by the first pass is still in
  L2 for the second.
- ``_ce_slab_grad_kernel``: the slab scheme's second pass — a vocabulary slab's logits for all
  tokens ``[N, S]`` overwritten by their gradient from each row's log-sum-exp, which the row
  kernel stores when asked (``lse_out``).
- ``_dw_accum_kernel``: ``acc[V, D] (+)= dlogitsᵀ[V, C] · h[C, D]`` with the fp32 accumulator in
  global memory: loaded once per tile, added to, stored. cuBLAS does this only when torch
  accepts an fp32 ``out`` for bf16/fp16 operands (``addmm(..., out_dtype=torch.float32)``), which
  older torch builds do not; this kernel is what runs then (and on the CPU interpreter).
- ``_scale_kernel``: ``dst = src · g`` for a 0-d ``g`` on the device, optionally skipping the
  pass when ``g == 1`` (the usual ``loss.backward()``) without a host sync.

Loops run to compile-time trip counts: the Triton 3.6 interpreter cannot loop to a run-time
bound. The vocabulary loop's count depends on V only (fixed per model); the dW kernel's on the
chunk capacity, not the rows of the last chunk, so a new batch size compiles nothing new.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.launch_config import LaunchConfig, resolve_launch_config
from hydra_kernels.ops._custom_op import cdiv, dot_operand, next_power_of_2, persistent_grid, to_output_dtype

#: Row-kernel launch table: ``block_q`` = vocabulary block, ``block_rows`` = rows handled side by
#: side (1 on GPUs, where a row of a large vocabulary is plenty of work; 16 under the CPU
#: interpreter, whose cost is per operation, not per element), ``num_warps``. Override with
#: ``set_launch_overrides("linear_cross_entropy_rows", ...)``.
ROW_LAUNCH: dict[str, LaunchConfig] = {
    "blackwell": LaunchConfig(num_warps=16, num_stages=1, block_rows=1, block_q=8192),
    "hopper": LaunchConfig(num_warps=16, num_stages=1, block_rows=1, block_q=8192),
    "ampere": LaunchConfig(num_warps=8, num_stages=1, block_rows=1, block_q=4096),
    "default": LaunchConfig(
        num_warps=4, num_stages=1, block_rows=16 if controls.INTERPRETER_ACTIVE else 1, block_q=1024
    ),
}

#: Programs per SM of the row kernel's persistent grid. Few rows in flight keep each row in L2
#: between its two passes (2 × 132 rows × 100 KB at V = 50304 is ~26 MB of a 50 MB L2).
ROW_PROGRAMS_PER_SM: dict[str, int] = {"blackwell": 2, "hopper": 2, "ampere": 2, "default": 2}

#: dW-GEMM launch table: ``block_q`` × ``block_kv`` = the (vocab, dim) output tile, ``block_rows``
#: = the reduction step over the chunk's tokens. Override with
#: ``set_launch_overrides("linear_cross_entropy", ...)``. Blackwell takes the seed tuning's
#: warps/stages/tiles (BLOCK_Q 128, BLOCK_KV 64).
DW_LAUNCH: dict[str, LaunchConfig] = {
    "blackwell": LaunchConfig(num_warps=8, num_stages=3, block_rows=64, block_q=128, block_kv=64),
    "hopper": LaunchConfig(num_warps=8, num_stages=3, block_rows=64, block_q=128, block_kv=128),
    "ampere": LaunchConfig(num_warps=4, num_stages=3, block_rows=32, block_q=128, block_kv=64),
    "default": LaunchConfig(num_warps=4, num_stages=2, block_rows=32, block_q=64, block_kv=64),
}


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    logits_row_stride,
    targets_ptr,
    loss_ptr,
    scale_ptr,
    scale_stride,
    n_rows,
    n_cols,
    ignore_index,
    z_loss,
    lse_ptr,
    WRITE_GRAD: tl.constexpr,
    HAS_Z: tl.constexpr,
    STORE_LSE: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    ITERS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    for i in range(ITERS):
        rows = (pid + i * n_programs) * ROW_BLOCK + tl.arange(0, ROW_BLOCK)  # [R]
        row_ok = rows < n_rows
        row_ptr = logits_ptr + rows.to(tl.int64) * logits_row_stride
        y = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
        valid = y != ignore_index
        in_range = (y >= 0) & (y < n_cols)

        # Pass 1: online max / sum of exp over vocabulary blocks, all in fp32.
        # A finite "minus infinity" start: rows past n_rows (all -inf) then give exp(0), not NaN.
        m = tl.full([ROW_BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([ROW_BLOCK], tl.float32)
        for b in range(N_BLOCKS):
            cols = b * BLOCK_V + cols0
            mask = row_ok[:, None] & (cols < n_cols)[None, :]
            x = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=float("-inf"))
            x = x.to(tl.float32)  # [R, BLOCK_V]
            m_new = tl.maximum(m, tl.max(x, 1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), 1)
            m = m_new
        lse = tl.where(row_ok, m + tl.log(tl.where(row_ok, s, 1.0)), 0.0)  # [R]
        x_y = tl.load(row_ptr + tl.where(in_range, y, 0), mask=row_ok & valid & in_range, other=0.0)
        loss = lse - x_y.to(tl.float32)
        if HAS_Z:
            loss += z_loss * lse * lse
        # A target outside [0, V) that is not ignore_index gives NaN: visible, and no stray read.
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_ok)
        if STORE_LSE:
            tl.store(lse_ptr + rows, lse, mask=row_ok)

        if WRITE_GRAD:
            # d(lse)/dx = softmax; d(z·lse²)/dx = 2z·lse·softmax; d(−x_y)/dx = −onehot.
            scale = tl.load(scale_ptr + rows * scale_stride, mask=row_ok, other=0.0).to(tl.float32)
            scale = tl.where(valid, scale, 0.0)
            coef = scale
            if HAS_Z:
                coef = scale * (1.0 + 2.0 * z_loss * lse)
            for b in range(N_BLOCKS):
                cols = b * BLOCK_V + cols0
                mask = row_ok[:, None] & (cols < n_cols)[None, :]
                ptrs = row_ptr[:, None] + cols[None, :]
                x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                # exp(x − lse) ≤ 1, so an ignored row (coef 0) writes exact zeros
                g = tl.exp(x - lse[:, None]) * coef[:, None]
                g = tl.where(cols[None, :] == y[:, None], g - scale[:, None], g)
                tl.store(ptrs, to_output_dtype(g, logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_slab_grad_kernel(
    logits_ptr,
    n_rows,
    n_cols,
    col0,
    lse_ptr,
    targets_ptr,
    scale_ptr,
    scale_stride,
    ignore_index,
    z_loss,
    HAS_Z: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One [BLOCK_R, BLOCK_C] tile of a vocabulary slab's logits [n_rows, n_cols] (contiguous,
    # columns col0.. of the vocabulary), overwritten by their gradient from the row's stored lse.
    # The arithmetic is _ce_rows_kernel's second pass, term for term, so both passes of the
    # "slab" scheme produce the same gradient values from the same logits.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    y = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = y != ignore_index
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    scale = tl.load(scale_ptr + rows * scale_stride, mask=row_ok, other=0.0).to(tl.float32)
    scale = tl.where(valid, scale, 0.0)
    coef = scale
    if HAS_Z:
        coef = scale * (1.0 + 2.0 * z_loss * lse)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.exp(x - lse[:, None]) * coef[:, None]
    g = tl.where((cols + col0)[None, :] == y[:, None], g - scale[:, None], g)
    tl.store(ptrs, to_output_dtype(g, logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def vocab_major_tile(n_cols, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows, columns), int64, of this program's tile of a [V, n_cols] output; consecutive
    programs share a vocabulary tile (and its strip of the logits' gradient, from L2)."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(n_cols, BLOCK_D)
    pid_v = pid // n_col_tiles
    pid_d = pid - pid_v * n_col_tiles
    offs_v = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    return offs_v, offs_d


@triton.jit
def _dw_accum_kernel(
    g_ptr,
    stride_gc,
    stride_gv,
    h_ptr,
    stride_hc,
    stride_hd,
    acc_ptr,
    stride_av,
    stride_ad,
    n_rows,
    n_vocab,
    n_dim,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    K_BLOCKS: tl.constexpr,
):
    # The chunk of h is small enough to stay in L2 for the whole launch.
    offs_v, offs_d = vocab_major_tile(n_dim, BLOCK_V, BLOCK_D)
    v_ok = offs_v < n_vocab
    d_ok = offs_d < n_dim
    acc = tl.zeros([BLOCK_V, BLOCK_D], dtype=tl.float32)
    for kb in range(K_BLOCKS):
        offs_c = (kb * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        c_ok = offs_c < n_rows
        # [BLOCK_V, BLOCK_C] tile of dlogitsᵀ, read from row-major dlogits [C, V]
        a = tl.load(
            g_ptr + offs_c[None, :] * stride_gc + offs_v[:, None] * stride_gv,
            mask=c_ok[None, :] & v_ok[:, None],
            other=0.0,
        )
        b = tl.load(
            h_ptr + offs_c[:, None] * stride_hc + offs_d[None, :] * stride_hd,
            mask=c_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        a, b = dot_operand(a), dot_operand(b)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")  # fp32 operands: no TF32 rounding
        else:
            acc += tl.dot(a, b)
    out_ptrs = acc_ptr + offs_v[:, None] * stride_av + offs_d[None, :] * stride_ad
    out_mask = v_ok[:, None] & d_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, to_output_dtype(acc, acc_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _scale_kernel(src_ptr, dst_ptr, n, g_ptr, SKIP_IF_ONE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr).to(tl.float32)
    if SKIP_IF_ONE:
        if g != 1.0:
            x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst_ptr + offs, to_output_dtype(x * g, dst_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, to_output_dtype(x * g, dst_ptr.dtype.element_ty), mask=mask)


# --- host launchers --------------------------------------------------------------------------


def launch_ce_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_out: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    write_grad: bool,
    lse_out: torch.Tensor | None = None,
) -> None:
    """Loss per row of ``logits [rows, V]`` into ``loss_out [rows]`` (fp32); with ``write_grad``
    the logits are overwritten by their gradient times ``scale`` (0-d, or one value per row);
    with ``lse_out`` (fp32 [rows]) each row's log-sum-exp is stored too."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if logits.stride(1) != 1 or not targets.is_contiguous():  # the kernel reads neither by a stride
        raise ValueError("launch_ce_rows: the logits chunk needs a unit column stride, targets a unit stride")
    cfg = resolve_launch_config("linear_cross_entropy_rows", logits.device, ROW_LAUNCH)
    block_v = min(cfg.block_q, next_power_of_2(n_cols))
    for name, value in (("block_q", cfg.block_q), ("block_rows", cfg.block_rows)):
        if value & (value - 1):
            raise ValueError(f"linear_cross_entropy_rows: {name}={value} must be a power of two")
    programs, iters = persistent_grid(cdiv(n_rows, cfg.block_rows), logits.device, ROW_PROGRAMS_PER_SM)
    _ce_rows_kernel[(programs,)](
        logits,
        logits.stride(0),
        targets,
        loss_out,
        scale,
        scale.stride(0) if scale.dim() else 0,
        n_rows,
        n_cols,
        ignore_index,
        float(z_loss),
        lse_out if lse_out is not None else loss_out,
        WRITE_GRAD=write_grad,
        HAS_Z=z_loss != 0.0,
        STORE_LSE=lse_out is not None,
        ROW_BLOCK=cfg.block_rows,
        BLOCK_V=block_v,
        N_BLOCKS=cdiv(n_cols, block_v),
        ITERS=iters,
        num_warps=max(1, min(cfg.num_warps, cfg.block_rows * block_v // 64)),
    )


#: Tile of the slab-gradient kernel (rows × vocabulary columns); elementwise, 16 values a thread.
SLAB_TILE = (16, 256)


def launch_ce_slab_grad(
    slab: torch.Tensor,
    col0: int,
    lse: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
) -> None:
    """Overwrite ``slab`` (contiguous logits [N, c] of vocabulary columns ``col0..col0+c``) by the
    logits' gradient times ``scale``, from each row's log-sum-exp ``lse`` (fp32 [N])."""
    n_rows, n_cols = slab.shape
    if n_rows == 0 or n_cols == 0:
        return
    if not (slab.is_contiguous() and targets.is_contiguous()):
        raise ValueError("launch_ce_slab_grad: the slab and targets must be contiguous")
    block_r, block_c = SLAB_TILE
    if controls.INTERPRETER_ACTIVE:  # the interpreter's cost is per program: fewer, larger ones
        block_r, block_c = 32, 128
    _ce_slab_grad_kernel[(cdiv(n_rows, block_r), cdiv(n_cols, block_c))](
        slab,
        n_rows,
        n_cols,
        col0,
        lse,
        targets,
        scale,
        scale.stride(0) if scale.dim() else 0,
        ignore_index,
        float(z_loss),
        HAS_Z=z_loss != 0.0,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=8 if block_r * block_c >= 4096 else 4,
    )


def launch_dw_accum(
    acc: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor, accumulate: bool, capacity: int
) -> None:
    """``acc (+)= grad_logitsᵀ @ h`` with ``acc [V, D]``, ``grad_logits [C, V]``, ``h [C, D]``;
    ``capacity`` ≥ C is the chunk size the loop is compiled for (rows beyond C are masked)."""
    n_rows, n_vocab = grad_logits.shape
    n_dim = h.shape[1]
    cfg = resolve_launch_config("linear_cross_entropy", acc.device, DW_LAUNCH)
    for name in ("block_q", "block_kv", "block_rows"):
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"linear_cross_entropy dW tiles: {name}={value} must be a power of two ≥ 16")
    grid = (cdiv(n_vocab, cfg.block_q) * cdiv(n_dim, cfg.block_kv),)
    _dw_accum_kernel[grid](
        grad_logits,
        grad_logits.stride(0),
        grad_logits.stride(1),
        h,
        h.stride(0),
        h.stride(1),
        acc,
        acc.stride(0),
        acc.stride(1),
        n_rows,
        n_vocab,
        n_dim,
        ACCUMULATE=accumulate,
        IEEE=grad_logits.dtype == torch.float32,
        BLOCK_V=cfg.block_q,
        BLOCK_D=cfg.block_kv,
        BLOCK_C=cfg.block_rows,
        K_BLOCKS=cdiv(max(capacity, n_rows), cfg.block_rows),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def launch_scale(src: torch.Tensor, dst: torch.Tensor, g: torch.Tensor, skip_if_one: bool) -> None:
    """``dst = src · g`` (both contiguous, same numel; ``g`` 0-d on the device). With
    ``skip_if_one`` (only for ``dst is src``) the kernel reads g and writes nothing when g == 1."""
    if not (src.is_contiguous() and dst.is_contiguous()) or src.numel() != dst.numel():
        raise ValueError("launch_scale: src and dst must be contiguous and of one size")
    n = src.numel()
    if n == 0:
        return
    block = 4096
    _scale_kernel[(cdiv(n, block),)](src, dst, n, g, SKIP_IF_ONE=skip_if_one, BLOCK=block, num_warps=8)
