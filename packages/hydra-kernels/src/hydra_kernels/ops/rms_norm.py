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

Kernels (in ``ops/_rms_norm_kernels.py``; whole rows live in registers, so widths up to
:data:`MAX_FUSED_DIM`; wider rows make the launcher raise, which the caller counts as a fallback
and answers with the reference):

- ``_rms_norm_fwd_kernel``: ``BLOCK_ROWS`` rows per program. With ``HAS_RESIDUAL`` it forms
  ``s = x + residual``, stores ``s`` rounded to the output dtype and normalises that rounded
  ``s``, so ``normed == rms_norm(summed)`` for the ``summed`` it returns. Nothing else is saved:
  the backward recomputes rstd from x, which costs registers, not memory traffic.
- ``_rms_norm_bwd_kernel``: persistent style, ~``BWD_PROGRAMS_PER_SM`` programs per SM, each
  walking ``ITERS`` consecutive row blocks: one pass over x and dy, dx into fresh memory (plus
  the residual stream's own gradient with ``HAS_DSUM``; with ``HAS_DRES`` a second copy of dx for
  the residual, see ``_fused_add_setup``), dy·x̂ summed in fp32 registers, one fp32 partial row
  per program.
- ``_dw_reduce_kernel``: sums the ``[n_programs, D]`` partials once and writes dW in the
  weight's dtype.

No kernel writes into the storage of an input or of an incoming gradient.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import BLACKWELL_TUNING, LaunchConfig
from hydra_kernels.ops._custom_op import (
    WidthTables,
    cdiv,
    compiling,
    device_guard,
    eager_apply,
    eager_autograd_function,
    launch_config_for,
    next_power_of_2,
    persistent_grid,
    run_with_fallback,
    upcast,
)
from hydra_kernels.ops._launch import LaunchPlan, empty_like_contiguous, plan_cache
from hydra_kernels.ops._rms_norm_kernels import _dw_reduce_kernel, _rms_norm_bwd_kernel, _rms_norm_fwd_kernel

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


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference RMSNorm over the last dim: fp32 statistics (fp64 for fp64 x), result in x's dtype."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * upcast(weight)).to(x.dtype)


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
    xf, dyf = upcast(x), upcast(dy)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * upcast(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + upcast(dsum)
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


# --- Triton kernels: ops/_rms_norm_kernels.py ----------------------------------------------------


# --- host launchers ------------------------------------------------------------------------------
# Host time matters as much as kernel time here: at the sizes these ops see, one eager forward +
# backward is a few tens of microseconds of GPU work, so the launchers avoid per-call work that
# is not needed (views when the tensor is already contiguous, Triton's constexpr_function
# helpers, re-resolving launch tables: see _custom_op).


def _rows(t: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """(``t`` or a [rows, width] view/copy of it with unit column stride, its row stride)."""
    if t.is_contiguous():
        return t, width
    rows = t.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


def _block_d(op: str, width: int, weight: torch.Tensor, x: torch.Tensor, *same: torch.Tensor | None) -> int:
    """BLOCK_D for ``width``; raises (→ counted fallback) for what the kernels cannot take, which
    only a direct call of the custom ops can pass (the public functions check shapes first)."""
    if weight.numel() != width or any(t is not None and t.shape != x.shape for t in same):
        raise ValueError(f"{op}: weight and tensors must match x's last dim {width} and shape")
    if width == 0:
        raise ValueError(f"{op}: rows of width 0")
    if width > MAX_FUSED_DIM:
        raise ValueError(
            f"{op}: rows of {width} elements exceed the {MAX_FUSED_DIM} the fused kernel holds in "
            "registers; the PyTorch reference runs instead"
        )
    return next_power_of_2(width)


_FWD_PLANS = plan_cache()
_BWD_PLANS = plan_cache()


def _fwd_plan(
    x2: torch.Tensor, stride_x: int, res2: torch.Tensor | None, stride_res: int, weight, width, key
):
    """(LaunchPlan, output dtype) for the forward at this layout (cached under ``key``)."""
    block_d = _block_d("rms_norm", width, weight, x2, None)
    out_dtype = x2.dtype if res2 is None else torch.promote_types(x2.dtype, res2.dtype)
    n_rows = x2.numel() // width
    cfg = launch_config_for("rms_norm", x2.device, block_d, FWD_TABLES)
    block_rows = min(cfg.block_rows, next_power_of_2(n_rows))
    consts = {"N_COLS": width, "BLOCK_D": block_d, "BLOCK_ROWS": block_rows, "HAS_RESIDUAL": res2 is not None}
    plan = LaunchPlan(
        _rms_norm_fwd_kernel,
        (cdiv(n_rows, block_rows),),
        consts,
        cfg.num_warps,
        cfg.num_stages,
        x2.get_device(),
    )
    _FWD_PLANS[key] = (plan, out_dtype, n_rows)
    return _FWD_PLANS[key]


def rms_norm_fwd_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the forward kernel: (y, summed) where summed is None without a residual."""
    width = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if x.numel() == 0:
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        y = torch.empty(x.shape, dtype=dtype, device=x.device)
        return y, (torch.empty_like(y) if residual is not None else None)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    x2, stride_x = _rows(x, width)
    res2, stride_res = _rows(residual, width) if residual is not None else (None, 0)
    key = (x.shape, stride_x, stride_res, x.dtype, None if res2 is None else res2.dtype, weight.dtype,
           weight.numel(), x.get_device())  # fmt: skip
    plan, out_dtype, n_rows = _FWD_PLANS.get(key) or _fwd_plan(
        x2, stride_x, res2, stride_res, weight, width, key
    )
    y = empty_like_contiguous(x, out_dtype)
    summed = torch.empty_like(y) if residual is not None else None
    with device_guard(x):
        plan(x2, x2 if res2 is None else res2, weight, y, y if summed is None else summed,
             n_rows, stride_x, stride_res, eps)  # fmt: skip
    return y, summed


def _bwd_plans(x2, weight, width, has_dsum, split, key):
    """(bwd LaunchPlan, reduce LaunchPlan, programs, n_rows) for this layout (cached under key)."""
    block_d = _block_d("rms_norm", width, weight, x2, None)
    n_rows = x2.numel() // width
    cfg = launch_config_for("rms_norm_bwd", x2.device, block_d, BWD_TABLES)
    block_rows = min(cfg.block_rows, next_power_of_2(n_rows))
    n_programs, iters = persistent_grid(cdiv(n_rows, block_rows), x2.device, BWD_PROGRAMS_PER_SM)
    dev = x2.get_device()
    consts = {"N_COLS": width, "BLOCK_D": block_d, "BLOCK_ROWS": block_rows, "ITERS": iters,
              "HAS_DSUM": has_dsum, "HAS_DRES": split, "LOOP_STAGES": cfg.num_stages}  # fmt: skip
    bwd = LaunchPlan(_rms_norm_bwd_kernel, (n_programs,), consts, cfg.num_warps, cfg.num_stages, dev)
    consts = {"N_COLS": width, "BLOCK_P": _REDUCE_BLOCK_P, "BLOCK_C": _REDUCE_BLOCK_C,
              "P_ITERS": cdiv(n_programs, _REDUCE_BLOCK_P)}  # fmt: skip
    reduce = LaunchPlan(_dw_reduce_kernel, (cdiv(width, _REDUCE_BLOCK_C),), consts, 4, 2, dev)
    _BWD_PLANS[key] = (bwd, reduce, n_programs, n_rows)
    return _BWD_PLANS[key]


def rms_norm_bwd_launch(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dsum: torch.Tensor | None,
    split_residual_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Run the backward kernels: (dx [+ dsum], dW), or with ``split_residual_grad`` (dx, a second
    copy of dx, dW) — written by the kernel in the same pass, cheaper than autograd's clone when
    one tensor would otherwise be the gradient of two leaves."""
    width = x.shape[-1]
    if dy.shape != x.shape or (dsum is not None and dsum.shape != x.shape):
        raise ValueError(f"rms_norm: incoming gradients must have x's shape {tuple(x.shape)}")
    if x.numel() == 0:
        dx, dw0 = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.zeros_like(weight)
        return (dx, torch.empty_like(dx), dw0) if split_residual_grad else (dx, dw0)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    x2, stride_x = _rows(x, width)
    dy2, stride_dy = _rows(dy, width)
    ds2, stride_ds = _rows(dsum, width) if dsum is not None else (dy2, 0)
    key = (x.shape, stride_x, stride_dy, stride_ds, dsum is not None, split_residual_grad, x.dtype, dy.dtype,
           weight.dtype, weight.numel(), x.get_device())  # fmt: skip
    bwd, reduce, n_programs, n_rows = _BWD_PLANS.get(key) or _bwd_plans(
        x2, weight, width, dsum is not None, split_residual_grad, key
    )
    dx = empty_like_contiguous(x)
    dres = torch.empty_like(dx) if split_residual_grad else None
    partial = torch.empty((n_programs, width), dtype=torch.float32, device=x.device)
    dw = torch.empty_like(weight)
    with device_guard(x):
        bwd(
            dy2,
            x2,
            weight,
            ds2,
            dx,
            dx if dres is None else dres,
            partial,
            n_rows,
            stride_dy,
            stride_x,
            stride_ds,
            eps,
        )
        reduce(partial, dw, n_programs)
    return (dx, dres, dw) if split_residual_grad else (dx, dw)


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
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dsum: torch.Tensor | None,
    split_residual_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    def reference() -> tuple[torch.Tensor, ...]:
        dx, dw = rms_norm_backward_ref(dy, x, weight, eps, dsum)
        return (dx, dx.clone(), dw) if split_residual_grad else (dx, dw)

    # The backward switch is read here, at run time, so it holds inside compiled graphs too.
    if not controls.triton_path("rms_norm", dy, x, weight, backward=True):
        return reference()
    return run_with_fallback(
        "rms_norm", lambda: rms_norm_bwd_launch(dy, x, weight, eps, dsum, split_residual_grad), reference
    )


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
    # x + residual passes one gradient to both, as aten's add does. When that one tensor reaches a
    # leaf (AccumulateGrad), autograd must clone it for .grad: a full extra read and write. In
    # eager mode the backward kernel then writes a second copy itself (one extra write instead).
    summed_dtype = output[1].dtype
    ctx.split = (
        getattr(ctx, "eager", False)
        and x.requires_grad
        and residual.requires_grad
        and (x.is_leaf or residual.is_leaf)
        and x.dtype == residual.dtype == summed_dtype
    )


def _fused_add_grads(ctx, d_normed, d_summed):
    summed, weight = ctx.saved_tensors
    d_res = None
    if d_normed is None:  # only the sum was used downstream
        d_total, dw = d_summed, torch.zeros_like(weight)
    elif ctx.split:
        d_total, d_res, dw = _rms_norm_backward(d_normed, summed, weight, ctx.eps, d_summed, True)
    else:
        d_total, dw = _backward_impl(ctx)(d_normed, summed, weight, ctx.eps, d_summed)
    if d_total is None:
        return None, None, None, None
    if d_res is None:
        d_res = d_total.to(ctx.residual_dtype)
    return d_total.to(ctx.x_dtype), d_res, dw, None


_rms_norm_fwd_op.register_autograd(_rms_norm_grads, setup_context=_rms_norm_setup)
_fused_add_fwd_op.register_autograd(_fused_add_grads, setup_context=_fused_add_setup)

_RMSNormFunction = eager_autograd_function(
    "_RMSNormFunction", _rms_norm_forward, _rms_norm_setup, _rms_norm_grads
)
_FusedAddRMSNormFunction = eager_autograd_function(
    "_FusedAddRMSNormFunction", _fused_add_forward, _fused_add_setup, _fused_add_grads
)


# --- public functions ----------------------------------------------------------------------------


def _checked_args(x: torch.Tensor, weight: torch.Tensor, eps: object) -> float:
    """``eps`` as a Python float, after checking x and weight. The kernels and the custom ops'
    schemas take a float: a 0-d tensor made every launch fail (a counted fallback), and None
    failed inside the reference with a message that did not name eps."""
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dim (its last is normalised), got a 0-d tensor")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}; "
            "pass a 1-D weight of that length"
        )
    if isinstance(eps, torch.Tensor) and eps.numel() == 1:
        return float(eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"rms_norm: eps must be a real number (e.g. 1e-6), got {type(eps).__name__} {eps!r}")
    return float(eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), scaled by ``weight`` [D].

    fp32 statistics; the result has x's dtype; differentiable in x and weight. fp64 inputs run
    the reference (in fp64).
    """
    eps = _checked_args(x, weight, eps)
    if x.dtype == torch.float64 or not controls.triton_path("rms_norm", x, weight):
        return rms_norm_ref(x, weight, eps)
    if compiling():
        return _rms_norm_fwd_op(x, weight, eps)
    return eager_apply(_RMSNormFunction, x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` in one pass.

    Both outputs have the promoted dtype of ``x + residual``; differentiable in x, residual and
    weight. ``residual`` must have x's shape on the fused path (a broadcast residual takes the
    reference, as do fp64 inputs).
    """
    eps = _checked_args(x, weight, eps)
    fused = residual.shape == x.shape and torch.float64 not in (x.dtype, residual.dtype)
    if not (fused and controls.triton_path("rms_norm", x, residual, weight)):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    if compiling():
        return _fused_add_fwd_op(x, residual, weight, eps)
    return eager_apply(_FusedAddRMSNormFunction, x, residual, weight, eps)
