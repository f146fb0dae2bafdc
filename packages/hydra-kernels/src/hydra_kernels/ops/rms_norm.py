"""RMSNorm: y = x · rsqrt(mean(x²) + eps) · w, statistics in fp32; and its residual-add variant.

Faces: the PyTorch references (``rms_norm_ref``, ``fused_add_rms_norm_ref``), the Triton kernels
with their host launchers, ``torch.library`` custom ops ``hydra_kernels::rms_norm_fwd``,
``hydra_kernels::fused_add_rms_norm_fwd`` and ``hydra_kernels::rms_norm_bwd`` (what
torch.compile traces), and the public functions that choose between them
(:func:`hydra_kernels.controls.triton_path`).

Dtypes: every statistic and product is computed in fp32. The output has ``x``'s dtype (the fused
variant: the promoted dtype of ``x + residual``). ``weight`` may have another float dtype than
``x`` (fp32 weight with bf16 activations under autocast is the usual case): it is read as fp32
and its gradient is returned in its own dtype.

Kernels (whole rows live in registers, so widths up to :data:`MAX_FUSED_DIM`; wider rows make
the launcher raise, which the caller counts as a fallback and answers with the reference):

- ``_rms_norm_fwd_kernel``: ``BLOCK_ROWS`` rows per program. With ``HAS_RESIDUAL`` it forms
  ``s = x + residual``, stores ``s`` rounded to the output dtype and normalises that rounded
  ``s``, so ``normed == rms_norm(summed)`` for the ``summed`` it returns. Nothing else is saved:
  the backward recomputes rstd from x, which costs registers, not memory traffic.
- ``_rms_norm_bwd_kernel``: persistent style, ~``BWD_PROGRAMS_PER_SM`` programs per SM, each
  walking ``ITERS`` consecutive row blocks: one pass over x and dy, dx into fresh memory (plus
  the residual stream's own gradient with ``HAS_DSUM``), dy·x̂ summed in fp32 registers, one
  fp32 partial row per program.
- ``_dw_reduce_kernel``: sums the ``[n_programs, D]`` partials once and writes dW in the
  weight's dtype.

No kernel writes into the storage of an input or of an incoming gradient.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.launch_config import BLACKWELL_TUNING, LaunchConfig
from hydra_kernels.ops._custom_op import (
    WidthTables,
    compiling,
    device_guard,
    eager_autograd_function,
    launch_config_for,
    persistent_grid,
    run_with_fallback,
    to_output_dtype,
)

#: Widest row the kernels hold in registers.
MAX_FUSED_DIM = 16384

# Launch tables by padded row width (BLOCK_D): (largest BLOCK_D, {generation: config}). The aim is
# 16-32 elements per thread, i.e. 2-4 16-byte vector loads per tensor, with several rows per
# program for narrow rows so that each program still moves a few kB. Blackwell takes the seed
# tuning (8 warps, 3 stages) where rows are wide enough for 8 warps to have work.
_HOPPER_LIKE = {
    256: LaunchConfig(num_warps=2, num_stages=2, block_rows=8),
    512: LaunchConfig(num_warps=4, num_stages=2, block_rows=8),
    1024: LaunchConfig(num_warps=4, num_stages=2, block_rows=4),
    2048: LaunchConfig(num_warps=8, num_stages=2, block_rows=2),
    4096: LaunchConfig(num_warps=8, num_stages=2, block_rows=1),
    8192: LaunchConfig(num_warps=16, num_stages=2, block_rows=1),
    MAX_FUSED_DIM: LaunchConfig(num_warps=16, num_stages=2, block_rows=1),
}
FWD_TABLES: WidthTables = tuple(
    (
        width,
        {
            "hopper": cfg,
            "blackwell": BLACKWELL_TUNING if width in (2048, 4096) else cfg,
            "default": cfg,
        },
    )
    for width, cfg in _HOPPER_LIKE.items()
)
# The backward holds x, dy and the dW accumulator per element: the same shapes, plus num_stages
# for its row loop, each stage a [BLOCK_ROWS, BLOCK_D] tile of x and of dy in shared memory
# (3 stages: 48 kB up to 4096-wide rows).
BWD_TABLES: WidthTables = tuple(
    (width, {gen: replace(cfg, num_stages=3 if width <= 8192 else 2) for gen, cfg in table.items()})
    for width, table in FWD_TABLES
)

#: Target programs per SM of the persistent backward. More programs hide more latency but write
#: more fp32 dW partials (n_programs × D × 4 bytes); the bench script sweeps this.
BWD_PROGRAMS_PER_SM: dict[str, int] = {"blackwell": 2, "hopper": 2, "ampere": 2, "default": 2}

# Partials are reduced in tiles of this many program rows by this many columns.
_REDUCE_BLOCK_P = 32
_REDUCE_BLOCK_C = 64


# --- PyTorch references --------------------------------------------------------------------------


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for half types, unchanged for fp32/fp64 (so an fp64 run really is fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference RMSNorm over the last dim: fp32 statistics (fp64 for fp64 x), result in x's dtype."""
    xf = _upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _upcast(weight)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the residual variant: returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def rms_norm_backward_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dsum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of RMSNorm from the saved inputs, in fp32 (fp64 for fp64) PyTorch; ``dsum`` (a gradient that
    reaches x directly, e.g. the residual stream's) is added to dx. Runs when the fused backward
    is switched off or fails."""
    xf, dyf = _upcast(x), _upcast(dy)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * _upcast(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + _upcast(dsum)
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


# --- Triton kernels ------------------------------------------------------------------------------


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
    DY, X, W, DSUM, DX, DW_PARTIAL,
    n_rows, stride_dy, stride_x, stride_dsum, eps,
    N_COLS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, ITERS: tl.constexpr,
    HAS_DSUM: tl.constexpr, LOOP_STAGES: tl.constexpr,
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
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N_COLS + eps)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        proj = tl.sum(xhat * g, axis=1) / N_COLS
        dx = (g - xhat * proj[:, None]) * rstd[:, None]
        if HAS_DSUM:
            ds = tl.load(DSUM + rows[:, None] * stride_dsum + cols[None, :], mask=mask, other=0.0)
            dx += ds.to(tl.float32)
        tl.store(
            DX + rows[:, None] * N_COLS + cols[None, :], to_output_dtype(dx, DX.dtype.element_ty), mask=mask
        )
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


# --- host launchers ------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as [rows, width] with unit column stride: a view when strides allow, else a copy."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_width(op: str, width: int, weight: torch.Tensor, *same_shape: torch.Tensor | None) -> int:
    """BLOCK_D for ``width``; raises (→ counted fallback) for what the kernels cannot take, which
    only a direct call of the custom ops can pass (the public functions check shapes first)."""
    if weight.numel() != width or any(t is not None and t.shape != same_shape[0].shape for t in same_shape):
        raise ValueError(f"{op}: weight and tensors must match x's last dim {width} and shape")
    if width > MAX_FUSED_DIM:
        raise ValueError(
            f"{op}: rows of {width} elements exceed the {MAX_FUSED_DIM} the fused kernel holds in "
            "registers; the PyTorch reference runs instead"
        )
    return triton.next_power_of_2(width)


def rms_norm_fwd_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel: (y, summed) where summed is None without a residual."""
    width = x.shape[-1]
    block_d = _check_width("rms_norm", width, weight, x, residual)
    x2 = _as_rows(x, width)
    res2 = _as_rows(residual, width) if residual is not None else None
    out_dtype = x.dtype if residual is None else torch.result_type(x, residual)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(y) if residual is not None else None
    n_rows = x2.shape[0]
    if n_rows == 0:
        return y, summed
    cfg = launch_config_for("rms_norm", x.device, block_d, FWD_TABLES)
    block_rows = min(cfg.block_rows, triton.next_power_of_2(n_rows))
    with device_guard(x):
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x2, res2 if res2 is not None else x2, weight.contiguous(), y, summed if summed is not None else y,
            n_rows, x2.stride(0), res2.stride(0) if res2 is not None else 0, eps,
            N_COLS=width, BLOCK_D=block_d, BLOCK_ROWS=block_rows, HAS_RESIDUAL=residual is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return y, summed


def rms_norm_bwd_launch(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, dsum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the backward kernels: (dx [+ dsum], dW)."""
    width = x.shape[-1]
    block_d = _check_width("rms_norm", width, weight, x, dy, dsum)
    x2, dy2 = _as_rows(x, width), _as_rows(dy, width)
    ds2 = _as_rows(dsum, width) if dsum is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    cfg = launch_config_for("rms_norm_bwd", x.device, block_d, BWD_TABLES)
    block_rows = min(cfg.block_rows, triton.next_power_of_2(n_rows))
    n_programs, iters = persistent_grid(triton.cdiv(n_rows, block_rows), x.device, BWD_PROGRAMS_PER_SM)
    partial = torch.empty((n_programs, width), dtype=torch.float32, device=x.device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    with device_guard(x):
        _rms_norm_bwd_kernel[(n_programs,)](
            dy2, x2, weight.contiguous(), ds2 if ds2 is not None else dy2, dx, partial,
            n_rows, dy2.stride(0), x2.stride(0), ds2.stride(0) if ds2 is not None else 0, eps,
            N_COLS=width, BLOCK_D=block_d, BLOCK_ROWS=block_rows, ITERS=iters, HAS_DSUM=dsum is not None,
            LOOP_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        _dw_reduce_kernel[(triton.cdiv(width, _REDUCE_BLOCK_C),)](
            partial, dw, n_programs,
            N_COLS=width, BLOCK_P=_REDUCE_BLOCK_P, BLOCK_C=_REDUCE_BLOCK_C,
            P_ITERS=triton.cdiv(n_programs, _REDUCE_BLOCK_P), num_warps=4,
        )  # fmt: skip
    return dx, dw


# --- implementations behind the custom ops (Triton with a counted fallback) ---------------------


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return run_with_fallback(
        "rms_norm",
        lambda: rms_norm_fwd_launch(x, None, weight, eps)[0],
        lambda: rms_norm_ref(x, weight, eps).contiguous(),
    )


def _fused_add_forward(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
        return normed.contiguous(), summed.contiguous()

    return run_with_fallback("rms_norm", lambda: rms_norm_fwd_launch(x, residual, weight, eps), reference)


def _rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, dsum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    reference = lambda: rms_norm_backward_ref(dy, x, weight, eps, dsum)
    # The backward switch is read here, at run time, so it holds inside compiled graphs too.
    if not controls.triton_path("rms_norm", dy, x, weight, backward=True):
        return reference()
    return run_with_fallback("rms_norm", lambda: rms_norm_bwd_launch(dy, x, weight, eps, dsum), reference)


# --- torch.library registration ------------------------------------------------------------------


@torch.library.custom_op("hydra_kernels::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_forward(x, weight, eps)


@_rms_norm_fwd_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("hydra_kernels::fused_add_rms_norm_fwd", mutates_args=())
def _fused_add_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_add_forward(x, residual, weight, eps)


@_fused_add_fwd_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.result_type(x, residual)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("hydra_kernels::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, dsum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_backward(dy, x, weight, eps, dsum)


@_rms_norm_bwd_op.register_fake
def _(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, dsum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _backward_impl(ctx):  # raw implementation in eager mode, the traceable op under compile
    return _rms_norm_backward if getattr(ctx, "eager", False) else _rms_norm_bwd_op


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_grads(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _backward_impl(ctx)(dy, x, weight, ctx.eps, None)
    return dx, dw, None


def _fused_add_setup(ctx, inputs, output) -> None:
    x, residual, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.x_dtype, ctx.residual_dtype = eps, x.dtype, residual.dtype
    ctx.set_materialize_grads(False)


def _fused_add_grads(ctx, d_normed, d_summed):
    summed, weight = ctx.saved_tensors
    if d_normed is None:  # only the sum was used downstream
        d_total, dw = d_summed, torch.zeros_like(weight)
    else:
        d_total, dw = _backward_impl(ctx)(d_normed, summed, weight, ctx.eps, d_summed)
    if d_total is None:
        return None, None, None, None
    # x + residual passes the same gradient to both, as aten's add does.
    return d_total.to(ctx.x_dtype), d_total.to(ctx.residual_dtype), dw, None


_rms_norm_fwd_op.register_autograd(_rms_norm_grads, setup_context=_rms_norm_setup)
_fused_add_fwd_op.register_autograd(_fused_add_grads, setup_context=_fused_add_setup)

_RMSNormFunction = eager_autograd_function(
    "_RMSNormFunction", _rms_norm_forward, _rms_norm_setup, _rms_norm_grads
)
_FusedAddRMSNormFunction = eager_autograd_function(
    "_FusedAddRMSNormFunction", _fused_add_forward, _fused_add_setup, _fused_add_grads
)


# --- public functions ----------------------------------------------------------------------------


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}; "
            "pass a 1-D weight of that length"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), scaled by ``weight`` [D].

    fp32 statistics; the result has x's dtype; differentiable in x and weight. fp64 inputs run
    the reference (in fp64).
    """
    _check_weight(x, weight)
    if x.dtype == torch.float64 or not controls.triton_path("rms_norm", x, weight):
        return rms_norm_ref(x, weight, eps)
    if compiling():
        return _rms_norm_fwd_op(x, weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` in one pass.

    Both outputs have the promoted dtype of ``x + residual``; differentiable in x, residual and
    weight. ``residual`` must have x's shape on the fused path (a broadcast residual takes the
    reference, as do fp64 inputs).
    """
    _check_weight(x, weight)
    fused = residual.shape == x.shape and torch.float64 not in (x.dtype, residual.dtype)
    if not (fused and controls.triton_path("rms_norm", x, residual, weight)):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    if compiling():
        return _fused_add_fwd_op(x, residual, weight, eps)
    return _FusedAddRMSNormFunction.apply(x, residual, weight, eps)
