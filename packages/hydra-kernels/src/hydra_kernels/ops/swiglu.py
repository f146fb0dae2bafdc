"""SwiGLU activation: silu(gate) · up, as a fused Triton forward and backward.

Two faces share the kernels:

* :func:`swiglu` takes ``gate`` and ``up`` of one shape (any leading dims). They may be row-strided
  views, such as the two halves of one ``[N, 2H]`` projection; those are read in place (a row
  stride is passed to the kernel), only a layout with no unit-stride last dim is copied.
* :func:`swiglu_packed` takes that ``[..., 2H]`` projection itself and returns ``[..., H]``. Its
  backward writes both halves of one ``[..., 2H]`` gradient directly, which is what a fused
  gate/up ``Linear`` wants: going through two slices instead makes autograd allocate, zero and add
  two full-size gradients.

The forward keeps nothing but its inputs; the backward recomputes ``sigmoid(gate)`` from them in
fp32. Kernels see every tensor as ``[rows, width]`` with a row stride. When all tensors of a call
are contiguous the whole tensor is one long row, so the grid is a flat 1-D walk over large blocks.
The two kernels themselves (``_swiglu_fwd_kernel``, ``_swiglu_bwd_kernel``) are in
``ops/_swiglu_kernels.py``.
"""

import torch
import torch.nn.functional as F

from hydra_kernels.controls import triton_path
from hydra_kernels.launch_config import LaunchConfig, resolve_launch_config
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    cdiv,
    check_devices,
    compiling,
    device_guard,
    eager_apply,
    eager_autograd_function,
    next_power_of_2,
    run_with_fallback,
)
from hydra_kernels.ops._launch import LaunchPlan, empty_like_contiguous, plan_cache
from hydra_kernels.ops._swiglu_kernels import _swiglu_bwd_kernel, _swiglu_fwd_kernel

#: Per-generation launch table. ``block_q`` is the most elements one program handles (rows
#: narrower or ragged get a smaller block, see :func:`row_block`);
#: ``num_warps``/``num_stages`` as usual (stages do not matter: there is no loop to pipeline).
#: Blackwell takes the seed tuning's warps and stages; the seed's BLOCK_Q is an attention tile
#: and does not apply to an elementwise op, so the element block stays the Hopper one.
LAUNCH_DEFAULTS: dict[str, LaunchConfig] = {
    "blackwell": LaunchConfig(num_warps=8, num_stages=3, block_q=4096),
    "hopper": LaunchConfig(num_warps=8, num_stages=1, block_q=4096),
    "ampere": LaunchConfig(num_warps=8, num_stages=1, block_q=2048),
    "default": LaunchConfig(num_warps=4, num_stages=1, block_q=1024),
}


# --- references ------------------------------------------------------------------------------


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32 for half types and fp32, fp64 for fp64 (so an fp64 call is a true fp64 reference)
    return torch.promote_types(t.dtype, torch.float32)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference: silu computed in fp32 (fp64 for fp64 inputs), result in the inputs' dtype."""
    cd = _compute_dtype(gate)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


def swiglu_bwd_ref(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form backward from the saved inputs (what runs when the fused backward is off)."""
    cd = _compute_dtype(gate)
    g, u, dy = gate.to(cd), up.to(cd), grad_out.to(cd)
    sig = torch.sigmoid(g)
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    dup = dy * g * sig
    return dgate.to(gate.dtype).contiguous(), dup.to(up.dtype).contiguous()


# --- host launchers --------------------------------------------------------------------------


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride: a view when one exists, else a copy."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def row_block(width: int, max_block: int) -> int:
    """Elements per program for rows of ``width``: the largest power of two ≤ ``max_block`` whose
    multiples pad the row by at most 15% (masked lanes still hold a program's slots), but not
    below 512 unless the row itself is shorter."""
    block = min(max_block, max(16, next_power_of_2(width)))
    while block > 512 and cdiv(width, block) * block > 1.15 * width:
        block //= 2
    return block


_PLANS = plan_cache()


def _plan(kernel, n_rows: int, n_cols: int, device: torch.device, key) -> LaunchPlan:
    cfg = resolve_launch_config("swiglu", device, LAUNCH_DEFAULTS)
    if cfg.block_q & (cfg.block_q - 1):
        raise ValueError(f"swiglu block_q must be a power of two, got {cfg.block_q}")
    block = row_block(n_cols, cfg.block_q)
    num_warps = max(1, min(cfg.num_warps, block // 128))
    col_blocks = cdiv(n_cols, block)
    grid = (n_rows * col_blocks,)
    plan = LaunchPlan(kernel, grid, {"BLOCK": block}, num_warps, cfg.num_stages, device.index or 0)
    _PLANS[key] = (plan, col_blocks)
    return _PLANS[key]


def _launch(kernel, ins: list[torch.Tensor], outs: list[torch.Tensor], width: int) -> None:
    """Run an elementwise SwiGLU kernel over ``ins`` (read) and ``outs`` (written), all of the
    same shape ``[..., width]``. ``outs`` must be views the caller keeps (written in place)."""
    numel = ins[0].numel()
    if numel == 0:
        return
    contiguous = True
    for t in ins:
        contiguous = contiguous and t.is_contiguous()
    for t in outs:
        contiguous = contiguous and t.is_contiguous()
    if contiguous:
        # One long row: no per-row tail, and the tensors go to the kernel as they are (making
        # views costs host time that at these sizes is comparable to the kernel's).
        tensors = [*ins, *outs]
        n_rows, n_cols = 1, numel
        strides = [numel] * len(tensors)
    else:
        # outs are allocated by the callers with a unit last stride: viewing them never copies
        tensors = [_rows(t, width) for t in ins] + [o.view(-1, width) for o in outs]
        n_rows, n_cols = tensors[0].shape
        strides = [t.stride(0) for t in tensors]
    dev = ins[0].device
    key = (kernel, n_rows, n_cols, *strides, ins[0].dtype, dev)
    plan, col_blocks = _PLANS.get(key) or _plan(kernel, n_rows, n_cols, dev, key)
    with device_guard(ins[0]):
        plan(*tensors, n_cols, col_blocks, *strides)


def _launch_swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = empty_like_contiguous(gate)
    _launch(_swiglu_fwd_kernel, [gate, up], [out], gate.shape[-1])
    return out


def _launch_swiglu_bwd(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = empty_like_contiguous(gate)
    dup = empty_like_contiguous(up)
    _launch(_swiglu_bwd_kernel, [gate, up, grad_out], [dgate, dup], gate.shape[-1])
    return dgate, dup


def _launch_swiglu_packed_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    h = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], h), dtype=gate_up.dtype, device=gate_up.device)
    _launch(_swiglu_fwd_kernel, [gate_up[..., :h], gate_up[..., h:]], [out], h)
    return out


def _launch_swiglu_packed_bwd(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    h = gate_up.shape[-1] // 2
    grad = empty_like_contiguous(gate_up)
    ins = [gate_up[..., :h], gate_up[..., h:], grad_out]
    _launch(_swiglu_bwd_kernel, ins, [grad[..., :h], grad[..., h:]], h)
    return grad


# --- torch.library ops: opaque to torch.compile, autograd attached ---------------------------
# The *_impl functions run the kernel; one that raises is counted and answered by the reference
# (run_with_fallback), so a broken kernel never silently changes results. Compiled code calls
# them through the custom ops; eager code through a plain autograd.Function (cheaper dispatch).


def _swiglu_fwd_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return run_with_fallback(
        "swiglu",
        lambda: _launch_swiglu_fwd(gate, up),
        lambda: swiglu_ref(gate, up).contiguous(),
    )


def _swiglu_bwd_impl(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_with_fallback(
        "swiglu",
        lambda: _launch_swiglu_bwd(gate, up, grad_out),
        lambda: swiglu_bwd_ref(gate, up, grad_out),
    )


def _swiglu_packed_fwd_impl(gate_up: torch.Tensor) -> torch.Tensor:
    return run_with_fallback(
        "swiglu",
        lambda: _launch_swiglu_packed_fwd(gate_up),
        lambda: _swiglu_packed_ref(gate_up).contiguous(),
    )


def _swiglu_packed_bwd_impl(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return run_with_fallback(
        "swiglu",
        lambda: _launch_swiglu_packed_bwd(gate_up, grad_out),
        lambda: _swiglu_packed_bwd_ref(gate_up, grad_out),
    )


@torch.library.custom_op("hydra_kernels::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _swiglu_fwd_impl(gate, up)


@_swiglu_fwd_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("hydra_kernels::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(
    gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_bwd_impl(gate, up, grad_out)


@_swiglu_bwd_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor):
    return (
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        torch.empty(up.shape, dtype=up.dtype, device=up.device),
    )


def _swiglu_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # gate, up: nothing else is kept


def _swiglu_backward(ctx, grad_out: torch.Tensor):
    gate, up = ctx.saved_tensors
    if triton_path("swiglu", gate, up, grad_out, backward=True):
        if getattr(ctx, "eager", False):
            return _swiglu_bwd_impl(gate, up, grad_out)
        return _swiglu_bwd_op(gate, up, grad_out)
    return swiglu_bwd_ref(gate, up, grad_out)


_swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)
_SwiGLUEager = eager_autograd_function(
    "SwiGLUEager", _swiglu_fwd_impl, _swiglu_setup_context, _swiglu_backward
)


@torch.library.custom_op("hydra_kernels::swiglu_packed_fwd", mutates_args=())
def _swiglu_packed_fwd_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _swiglu_packed_fwd_impl(gate_up)


@_swiglu_packed_fwd_op.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)


@torch.library.custom_op("hydra_kernels::swiglu_packed_bwd", mutates_args=())
def _swiglu_packed_bwd_op(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return _swiglu_packed_bwd_impl(gate_up, grad_out)


@_swiglu_packed_bwd_op.register_fake
def _(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


def _swiglu_packed_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_packed_backward(ctx, grad_out: torch.Tensor):
    (gate_up,) = ctx.saved_tensors
    if triton_path("swiglu", gate_up, grad_out, backward=True):
        if getattr(ctx, "eager", False):
            return _swiglu_packed_bwd_impl(gate_up, grad_out)
        return _swiglu_packed_bwd_op(gate_up, grad_out)
    return _swiglu_packed_bwd_ref(gate_up, grad_out)


_swiglu_packed_fwd_op.register_autograd(_swiglu_packed_backward, setup_context=_swiglu_packed_setup_context)
_SwiGLUPackedEager = eager_autograd_function(
    "SwiGLUPackedEager",
    _swiglu_packed_fwd_impl,
    _swiglu_packed_setup_context,
    _swiglu_packed_backward,
)


def _swiglu_packed_ref(gate_up: torch.Tensor) -> torch.Tensor:
    h = gate_up.shape[-1] // 2
    return swiglu_ref(gate_up[..., :h], gate_up[..., h:])


def _swiglu_packed_bwd_ref(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    h = gate_up.shape[-1] // 2
    dgate, dup = swiglu_bwd_ref(gate_up[..., :h], gate_up[..., h:], grad_out)
    return torch.cat([dgate, dup], dim=-1)


# --- public functions ------------------------------------------------------------------------


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    return t.dim() > 0 and t.dtype in KERNEL_DTYPES and triton_path("swiglu", *tensors)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise; gate and up have the same shape, dtype and device.

    Any leading dims; row-strided views (e.g. the halves of one ``[N, 2H]`` projection) are read
    without a copy. Math in fp32, result in the inputs' dtype. Differentiable in both inputs.
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate is {gate.dtype} and up is {up.dtype}; cast them to one dtype first")
    check_devices("swiglu", "gate up", gate, up)
    if _kernel_ok(gate, up):
        return _swiglu_fwd_op(gate, up) if compiling() else eager_apply(_SwiGLUEager, gate, up)
    return swiglu_ref(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :H]) * gate_up[..., H:]`` for ``gate_up`` ``[..., 2H]`` → ``[..., H]``.

    For the output of one fused gate/up projection: the gradient comes back as a single
    ``[..., 2H]`` tensor, written in one pass, with no slice-gradient copies.
    """
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"swiglu_packed: the last dim of gate_up {tuple(gate_up.shape)} must be even "
            "(gate and up halves side by side)"
        )
    if _kernel_ok(gate_up):
        if compiling():
            return _swiglu_packed_fwd_op(gate_up)
        return eager_apply(_SwiGLUPackedEager, gate_up)
    return _swiglu_packed_ref(gate_up)
