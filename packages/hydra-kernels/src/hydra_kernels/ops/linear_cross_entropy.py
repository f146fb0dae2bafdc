"""Cross-entropy of ``hidden @ weight.T`` against targets without the full [N, V] logits.

Scheme (decided for speed; measured by ``packages/hydra-diag/bench/bench_linear_ce.py``): tokens are
taken in chunks of C rows. Per chunk, with the gradient computed during the forward:

1. ``logits = h_c @ Wᵀ``  (cuBLAS, ``[C, V]`` in the compute dtype, one reused buffer)
2. ``_ce_rows_kernel`` (Triton): fp32 log-sum-exp, per-token loss, and the logits' gradient
   written over the logits in place;
3. ``dh_c = dlogits @ W``  (cuBLAS, straight into rows of dh) and
   ``dW += dlogitsᵀ @ h_c`` into an fp32 accumulator (cuBLAS with an fp32 ``out`` where torch
   supports it, else the ``_dw_accum_kernel`` Triton GEMM).

In this default mode the chunk's rows are padded to a multiple of 64 columns (zero weight rows,
left out of the softmax): cuBLAS runs a [C, V] operand whose row length is not 16-byte aligned
(a tokenizer's V = 27813) with slow alignment-1 kernels (``_linear_ce_chunks.PAD_COLS``). At such
a V the weight is then copied once a call (V·D in the compute dtype) even when it needs no cast.

Three matmuls in all, the minimum; backward only scales by the incoming gradient. Memory above
the inputs and the gradients themselves: one logits chunk plus, for a bf16/fp16 weight, the fp32
dW accumulator (V·D·4 bytes). With an fp32 weight (autocast training with fp32 master weights)
the accumulator *is* the gradient, so only the chunk (and W's bf16 copy) is extra.

Why fp32 for dW: the project's criterion ``|kernel − fp64| ≤ 2·|torch − fp64| + atol`` holds on
dW only if dW is rounded once, as torch's single GEMM does. Accumulating it in bf16 across k
chunks (Liger's default) rounds k times: at k = 16..64 the max error was 2.3-6.9× torch's (CPU
simulation, see the README). ``HYDRA_LINEAR_CE_DW_ACCUM=input`` selects that memory-lean mode anyway
(the accumulator in the weight's dtype, Liger-sized chunks): Liger's memory, Liger's precision.
``HYDRA_LINEAR_CE_DW_ACCUM=slab`` keeps the precision in Liger's memory instead, at the price of a
fourth matmul: no accumulator, dW per vocabulary slab in one GEMM after a second logits pass
(``_linear_ce_chunks``). ``HYDRA_LINEAR_CE_DW_ACCUM=compensated`` keeps three matmuls and the
precision with V·D/2 extra bytes: dW accumulates in its own 16-bit tensor plus a 4-bit residual
per element (``_linear_ce_compensated``), and its automatic chunk fits twice Liger's workspace.

``reduction="none"``: dW = Σ_n g_n·dlogits_nᵀ h_n needs the per-token gradient before the sum, so
the forward computes only the loss and the backward recomputes the chunks (four matmuls).
No grad wanted (eval), or an input that does not require grad (frozen head): that work is
skipped. The public function is a ``torch.library`` op (``hydra_kernels::linear_ce_fwd`` and
``::linear_ce_bwd``) when torch.compile traces, a plain autograd.Function in eager mode.

Options (``set_linear_ce_options`` or the environment; the bench script sweeps them):
``HYDRA_LINEAR_CE_CHUNK_ROWS`` (0 = automatic), ``HYDRA_LINEAR_CE_DW_ACCUM`` (``fp32`` |
``input`` | ``slab`` | ``compensated``), ``HYDRA_LINEAR_CE_DW_BACKEND`` (``auto`` | ``cublas`` |
``triton`` | ``torch``).

The options as read and set (``ops/_linear_ce_options.py``) and the reference with its gradient
tolerances (``ops/_linear_ce_reference.py``) have modules of their own; they are re-exported here.
"""

from __future__ import annotations

import contextlib

import torch

from hydra_kernels import controls
from hydra_kernels.ops import _linear_ce_kernels as K
from hydra_kernels.ops._custom_op import KERNEL_DTYPES, compiling, eager_autograd_function, run_with_fallback
from hydra_kernels.ops._linear_ce_chunks import (
    LinearCEOptions,
    acc_dtype_for,
    chunked_pass,
    cublas_backend_error,
)
from hydra_kernels.ops._linear_ce_liger import liger_linear_cross_entropy
from hydra_kernels.ops._linear_ce_options import (  # noqa: F401 (set/reset: re-exported for callers)
    linear_ce_options,
    reset_linear_ce_options,
    set_linear_ce_options,
)
from hydra_kernels.ops._linear_ce_reference import (  # noqa: F401 (re-exported: tests, checks, bench)
    grad_rounding_atol,
    linear_cross_entropy_ref,
)

OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    # The op fixes its own dtypes; an enclosing autocast must not recast the chunk matmuls.
    return (
        torch.autocast(device_type, enabled=False)
        if device_type in ("cuda", "cpu")
        else contextlib.nullcontext()
    )


def _run(use_triton: bool, fn):
    if use_triton:
        return run_with_fallback(OP, lambda: fn(True), lambda: fn(False))
    return fn(False)


# --- forward / backward implementations --------------------------------------------------------
# Argument lists are the custom ops' schemas: the trailing (use_triton, chunk_rows, dw_accum,
# dw_backend) are the dispatch decision and the options, fixed when the call was made.


def _fwd_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    z_loss: float,
    need_dh: bool,
    need_dw: bool,
    use_triton: bool,
    chunk_rows: int,
    dw_accum: str,
    dw_backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dh, dW accumulator); dh and dW are empty when not computed (always for "none")."""
    opts = LinearCEOptions(chunk_rows, dw_accum, dw_backend)
    grads = reduction != "none"
    need_dh, need_dw = need_dh and grads, need_dw and grads
    with _no_autocast(hidden.device.type):
        denom = (targets != ignore_index).sum().clamp_min(1).to(torch.float32)  # no host sync
        scale = (1.0 / denom) if reduction == "mean" else torch.ones((), device=hidden.device)
        loss_rows, dh, dw = _run(
            use_triton,
            lambda tri: chunked_pass(
                hidden, weight, targets, ignore_index, z_loss, scale, need_dh, need_dw, tri, opts
            ),
        )
        if reduction == "none":
            loss = loss_rows
        else:
            loss = loss_rows.sum()
            loss = loss / denom.to(loss.dtype) if reduction == "mean" else loss
    if dh is None:
        dh = hidden.new_empty((0,))
    if dw is None:
        dw = hidden.new_empty((0,), dtype=acc_dtype_for(hidden.dtype, weight.dtype, dw_accum))
    return loss, dh, dw


def _bwd_impl(
    grad_rows: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    need_dh: bool,
    need_dw: bool,
    use_triton: bool,
    chunk_rows: int,
    dw_accum: str,
    dw_backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reduction="none": recompute the chunks with the per-token gradient folded in."""
    opts = LinearCEOptions(chunk_rows, dw_accum, dw_backend)
    with _no_autocast(hidden.device.type):
        scale = grad_rows.reshape(-1).to(torch.float32).contiguous()
        _, dh, dw = _run(
            use_triton,
            lambda tri: chunked_pass(
                hidden, weight, targets, ignore_index, z_loss, scale, need_dh, need_dw, tri, opts
            ),
        )
    dh = hidden.new_empty((0,)) if dh is None else dh
    dw = weight.new_empty((0,)) if dw is None else dw.to(weight.dtype)
    return dh, dw


_fwd_op = torch.library.custom_op("hydra_kernels::linear_ce_fwd", _fwd_impl, mutates_args=())
_bwd_op = torch.library.custom_op("hydra_kernels::linear_ce_bwd", _bwd_impl, mutates_args=())


@_fwd_op.register_fake
def _fwd_fake(hidden, weight, targets, ignore_index, reduction, z_loss, need_dh, need_dw, *config):
    n, d = hidden.shape
    grads = reduction != "none"
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
    loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=loss_dtype)
    dh = hidden.new_empty((n, d) if grads and need_dh else (0,))
    dw_dtype = acc_dtype_for(hidden.dtype, weight.dtype, config[2])
    dw = hidden.new_empty((weight.shape[0], d) if grads and need_dw else (0,), dtype=dw_dtype)
    return loss, dh, dw


@_bwd_op.register_fake
def _bwd_fake(grad_rows, hidden, weight, targets, ignore_index, z_loss, need_dh, need_dw, *config):
    dh = hidden.new_empty(hidden.shape if need_dh else (0,))
    dw = weight.new_empty(weight.shape if need_dw else (0,))
    return dh, dw


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, targets, ignore_index, reduction, z_loss, need_dh, need_dw, *config = inputs
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.set_materialize_grads(False)  # dh/dw are never used downstream: no zero grads for them
    ctx.reduction, ctx.need_dh, ctx.need_dw = reduction, need_dh, need_dw
    ctx.weight_dtype = weight.dtype
    ctx.recompute_args = (ignore_index, z_loss, need_dh, need_dw, *config)
    ctx.use_triton = config[0]
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, targets)
    else:
        ctx.save_for_backward(dh, dw)


def _scale_grad(t: torch.Tensor, g: torch.Tensor, out_dtype: torch.dtype, ctx) -> torch.Tensor:
    """``t · g`` in ``out_dtype``. Eager: in place when the dtype already fits, skipping the pass
    on the device when g == 1; the version bump makes a second backward through this node
    (retain_graph=True) raise instead of reading scaled gradients. Compiled: out of place."""
    g = g.to(torch.float32)
    if not getattr(ctx, "eager", False):
        return (t * g).to(out_dtype)
    tri = ctx.use_triton and t.is_contiguous()
    if t.dtype == out_dtype:
        if tri:
            run_with_fallback(OP, lambda: K.launch_scale(t, t, g, skip_if_one=True), lambda: t.mul_(g))
            torch.autograd.graph.increment_version(t)
        else:
            t.mul_(g)
        return t
    if not tri:
        return (t * g).to(out_dtype)
    out = torch.empty(t.shape, dtype=out_dtype, device=t.device)

    def launch() -> torch.Tensor:
        K.launch_scale(t, out, g, skip_if_one=False)
        return out

    return run_with_fallback(OP, launch, lambda: (t * g).to(out_dtype))


def _backward(ctx, grad_loss, _grad_dh=None, _grad_dw=None):
    rest = (None,) * 10  # targets and the non-tensor arguments
    if grad_loss is None:
        return None, None, *rest
    if ctx.reduction == "none":
        hidden, weight, targets = ctx.saved_tensors
        args = (grad_loss, hidden, weight, targets, *ctx.recompute_args)
        dh, dw = _bwd_impl(*args) if getattr(ctx, "eager", False) else _bwd_op(*args)
    else:
        dh, dw = ctx.saved_tensors
        dh = _scale_grad(dh, grad_loss, dh.dtype, ctx) if ctx.need_dh else None
        dw = _scale_grad(dw, grad_loss, ctx.weight_dtype, ctx) if ctx.need_dw else None
    return (dh if ctx.need_dh else None), (dw if ctx.need_dw else None), *rest


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_LinearCEEager = eager_autograd_function("LinearCrossEntropyEager", _fwd_impl, _setup_context, _backward)


# --- public function -------------------------------------------------------------------------


def _validate(hidden, weight, targets, reduction, z_loss) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be [..., D] and weight "
            f"{tuple(weight.shape)} must be [V, D] with the same D and V ≥ 1"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets {tuple(targets.shape)} must have hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: targets must be integer class indices, got {targets.dtype}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(
            f"linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must be float"
        )
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"linear_cross_entropy: hidden ({hidden.device}), weight ({weight.device}) and targets "
            f"({targets.device}) must be on one device"
        )
    if z_loss != z_loss or z_loss in (float("inf"), float("-inf")):
        raise ValueError(f"linear_cross_entropy: z_loss must be finite, got {z_loss}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean (over non-ignored tokens), sum or per-token CE of ``hidden [N, D] @ weight [V, D].T``.

    ``hidden`` may have more leading dims (``[B, S, D]`` with ``targets [B, S]``) and any strides.
    Log-sum-exp in fp32; ``z_loss > 0`` adds ``z_loss · lse²`` per non-ignored token. With every
    token ignored, the mean is 0 and the gradients are zero. A target outside ``[0, V)`` that is
    not ``ignore_index`` makes its token's loss NaN. Matmuls run in ``hidden``'s dtype (the
    autocast dtype under autocast); gradients come back in each input's own dtype. The full
    ``[N, V]`` logits are never allocated (one chunk of them at a time).
    """
    _validate(hidden, weight, targets, reduction, z_loss)
    if hidden.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, D], a view when the strides allow
    y = targets.reshape(-1)
    if not y.is_contiguous():
        # the row kernels read token i's target at offset i: a strided view (a column of a label
        # tensor, every other label, an expanded constant) gave other tokens' targets, or read past
        # it. Copying N integers is cheap, and only such views pay it.
        y = y.contiguous()
    grad_on = torch.is_grad_enabled()
    need_dh, need_dw = grad_on and h2.requires_grad, grad_on and weight.requires_grad
    use_triton = h2.dtype in KERNEL_DTYPES and controls.triton_path(OP, h2, weight)
    opts = linear_ce_options()
    loss = None
    if use_triton and controls.use_liger_ce() and not compiling():
        loss = liger_linear_cross_entropy(
            h2, weight, y, ignore_index, reduction, float(z_loss), opts.dw_accum
        )
    if loss is None:
        # not while Dynamo traces: the check may probe cuBLAS on the device (once, cached)
        error = need_dw and not compiling() and cublas_backend_error(opts, h2.device, h2.dtype, weight.dtype)
        if error:
            raise ValueError(error)
        config = (use_triton, opts.chunk_rows, opts.dw_accum, opts.dw_backend)
        args = (h2, weight, y, int(ignore_index), reduction, float(z_loss), need_dh, need_dw, *config)
        if compiling():
            loss = _fwd_op(*args)[0]
        elif need_dh or need_dw:
            loss = _LinearCEEager.apply(*args)[0]
        else:
            loss = _fwd_impl(*args)[0]
    return loss.reshape(targets.shape) if reduction == "none" else loss
