"""Triton kernels of SwiGLU, forward and backward (see ``swiglu`` for the layout they see and for
the launchers that run them).

Separate from ``ops/swiglu.py`` so that the op's module holds its launchers, custom ops and public
functions, as ``ops/_rms_norm_kernels.py`` and ``ops/_ccgqa_conv_kernels.py`` do for theirs.
"""

import triton
import triton.language as tl

from hydra_kernels.ops._custom_op import to_output_dtype


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    col_blocks,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // col_blocks
    # 64-bit offsets: a flattened tensor can be longer than 2**31 elements.
    col0 = (pid - row * col_blocks).to(tl.int64) * BLOCK
    row = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols - col0
    g = tl.load(gate_ptr + row * gate_row_stride + col0 + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * up_row_stride + col0 + offs, mask=mask, other=0.0)
    g = g.to(tl.float32)
    # silu(g) = g / (1 + e^-g): finite for every finite g (e^-g -> inf gives -0, not nan).
    y = g / (1.0 + tl.exp(-g)) * u.to(tl.float32)
    tl.store(
        out_ptr + row * out_row_stride + col0 + offs,
        to_output_dtype(y, out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _swiglu_bwd_kernel(
    gate_ptr,
    up_ptr,
    dout_ptr,
    dgate_ptr,
    dup_ptr,
    n_cols,
    col_blocks,
    gate_row_stride,
    up_row_stride,
    dout_row_stride,
    dgate_row_stride,
    dup_row_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // col_blocks
    col0 = (pid - row * col_blocks).to(tl.int64) * BLOCK
    row = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols - col0
    g = tl.load(gate_ptr + row * gate_row_stride + col0 + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * up_row_stride + col0 + offs, mask=mask, other=0.0)
    dy = tl.load(dout_ptr + row * dout_row_stride + col0 + offs, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dy = dy.to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    # d silu / dg = sig + g·sig·(1 - sig) = sig·(1 + g·(1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(
        dgate_ptr + row * dgate_row_stride + col0 + offs,
        to_output_dtype(dg, dgate_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        dup_ptr + row * dup_row_stride + col0 + offs,
        to_output_dtype(du, dup_ptr.dtype.element_ty),
        mask=mask,
    )
