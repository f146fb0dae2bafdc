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

Kernels (in ``ops/_rms_norm_kernels.py``, launched by ``ops/_rms_norm_launch.py``, which also
holds the launch tables; whole rows live in registers, so widths up to :data:`MAX_FUSED_DIM`;
wider rows make the launcher raise, which the caller counts as a fallback and answers with the
reference):

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

import torch

from hydra_kernels import controls
from hydra_kernels.ops import _rms_norm_launch
from hydra_kernels.ops._custom_op import (  # noqa: F401 (launch_config_for: tests call it from here)
    check_devices,
    compiling,
    eager_apply,
    eager_autograd_function,
    launch_config_for,
    run_with_fallback,
    upcast,
)
from hydra_kernels.ops._rms_norm_kernels import (  # noqa: F401 (re-exported: tests compile them from here)
    _dw_reduce_kernel,
    _rms_norm_bwd_kernel,
    _rms_norm_fwd_kernel,
)
from hydra_kernels.ops._rms_norm_launch import (  # noqa: F401 (re-exported: tests and bench scripts)
    BWD_PROGRAMS_PER_SM,
    MAX_FUSED_DIM,
    rms_norm_bwd_launch,
    rms_norm_fwd_launch,
)

#: The launch tables (ops/_rms_norm_launch.py), bound here forward first: ``hydra-kernels status``
#: lists an op's tables by their names in its module, in the order that module binds them.
FWD_TABLES = _rms_norm_launch.FWD_TABLES
BWD_TABLES = _rms_norm_launch.BWD_TABLES


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


# --- launch tables and host launchers: ops/_rms_norm_launch.py -----------------------------------


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


def _checked_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: object,
    op: str = "rms_norm",
    residual: torch.Tensor | None = None,
) -> float:
    """``eps`` as a Python float, after checking x, weight (and the residual). The kernels and the
    custom ops' schemas take a float: a 0-d tensor made every launch fail (a counted fallback), and
    None failed inside the reference with a message that did not name eps."""
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dim (its last is normalised), got a 0-d tensor")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}; "
            "pass a 1-D weight of that length"
        )
    if residual is not None and residual.shape != x.shape:
        # A broadcast residual takes the reference, but x + residual must still have rows of the
        # weight's length: an x of one channel plus a wider residual normalised the wider rows
        # with the one-element weight broadcast over them, and a residual that did not broadcast
        # failed inside the reference with torch's message, naming neither argument.
        try:
            rows = torch.broadcast_shapes(x.shape, residual.shape)[-1]
        except RuntimeError:
            rows = None
        if rows != x.shape[-1]:
            raise ValueError(
                f"{op}: residual {tuple(residual.shape)} does not broadcast with x {tuple(x.shape)} to rows "
                f"of x's last dim {x.shape[-1]} (the weight's length); pass a residual of x's shape"
            )
    if residual is None:
        check_devices(op, "x weight", x, weight)
    else:
        check_devices(op, "x residual weight", x, residual, weight)
    if isinstance(eps, torch.Tensor) and eps.numel() == 1:
        return float(eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a real number (e.g. 1e-6), got {type(eps).__name__} {eps!r}")
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
    eps = _checked_args(x, weight, eps, "fused_add_rms_norm", residual)
    fused = residual.shape == x.shape and torch.float64 not in (x.dtype, residual.dtype)
    if not (fused and controls.triton_path("rms_norm", x, residual, weight)):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    if compiling():
        return _fused_add_fwd_op(x, residual, weight, eps)
    return eager_apply(_FusedAddRMSNormFunction, x, residual, weight, eps)
