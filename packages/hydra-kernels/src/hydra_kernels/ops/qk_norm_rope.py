"""QK norm then RoPE in one kernel each way: ``rope(qk_norm(x, scale, temperature), cos, sin)``.

Why: CCGQA normalises q and k per head and then rotates them (hydra_model/ccgqa.py). As two ops,
each of q and k takes four launches and nine passes over its memory (forward: read, write, read,
write; backward: read dz, write, read it and x, write dx); fused, two launches and five passes
(read x, write; read dz and x, write dx). The kernels are qk_norm's
(ops/_qk_norm_kernels.py, launched by ops/qk_norm.py) with RoPE's rotate-half added (``HALF`` >
0), so the per-head statistics are computed the one way.

**Same numbers as the two ops.** The norm's output is rounded to x's dtype before the rotation
reads it, and in the backward the rotated-back gradient is rounded to the gradient's dtype before
the norm's backward reads it: the roundings the unfused pair makes. So a fused forward gives the
values of ``rope(qk_norm(x))`` (and kv_decode's step, which rounds the same way, still matches a
full forward); the tests compare the two.

Faces: the references :func:`qk_norm_rope_ref` (the two references in a row) and
:func:`qk_norm_rope_backward_ref`; custom ops ``hydra_kernels::qk_norm_rope_fwd`` /
``hydra_kernels::qk_norm_rope_bwd`` (what torch.compile traces); the public :func:`qk_norm_rope`.
Its switch is its own (``HYDRA_DISABLE_FUSED_QK_NORM_ROPE``); where it is off, or where the tables
need a gradient, the call runs hydra_kernels' ``qk_norm`` and then ``rope``, each by its own switch.
Its launches take qk_norm's launch tables, and launch overrides set for ``qk_norm``.
"""

from __future__ import annotations

import torch

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    check_devices,
    compiling,
    eager_apply,
    eager_autograd_function,
    run_with_fallback,
    upcast,
)
from hydra_kernels.ops.qk_norm import (  # noqa: F401 (TABLES, BWD_TABLES: what `status` shows)
    BWD_TABLES,
    TABLES,
    constant_scale,
    qk_norm,
    qk_norm_backward_ref,
    qk_norm_bwd_launch,
    qk_norm_fwd_launch,
    qk_norm_ref,
)
from hydra_kernels.ops.rope import check_rope_shapes, rope, rope_ref

# --- PyTorch references --------------------------------------------------------------------------


def qk_norm_rope_ref(
    x: torch.Tensor, scale: float, temperature: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Reference: qk_norm's reference, then rope's (x [B, S, H, D]; cos/sin [S, R/2] or
    [B, S, R/2]); differentiable in x, temperature and the tables."""
    return rope_ref(qk_norm_ref(x, scale, temperature), cos, sin)


def qk_norm_rope_backward_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    temperature: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dtemperature or None): ``dy`` rotated back (RoPE is orthogonal: the inverse rotation,
    rounded to dy's dtype as rope's backward rounds it), then qk_norm's backward reference."""
    back = rope_ref(upcast(dy), cos, -sin).to(dy.dtype)
    return qk_norm_backward_ref(back, x, scale, temperature)


# --- implementations behind the custom ops (Triton with a counted fallback) ---------------------


def _forward(x, scale, temperature, cos, sin) -> torch.Tensor:
    return run_with_fallback(
        "qk_norm_rope",
        lambda: qk_norm_fwd_launch(x, scale, temperature, (cos, sin)),
        lambda: qk_norm_rope_ref(x, scale, temperature, cos, sin).contiguous(),
    )


def _backward(dy, x, scale, temperature, cos, sin) -> tuple[torch.Tensor, torch.Tensor | None]:
    reference = lambda: qk_norm_rope_backward_ref(dy, x, scale, temperature, cos, sin)
    # the backward switch is read at run time, so it holds inside compiled graphs too
    tensors = (dy, x) if temperature is None else (dy, x, temperature)
    if not controls.triton_path("qk_norm_rope", *tensors, backward=True):
        return reference()
    return run_with_fallback(
        "qk_norm_rope", lambda: qk_norm_bwd_launch(dy, x, scale, temperature, (cos, sin)), reference
    )


# --- torch.library registration ------------------------------------------------------------------


@torch.library.custom_op("hydra_kernels::qk_norm_rope_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, scale: float, temperature: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    # a direct call of the op skips the public function's checks; the kernel indexes the tables
    # by x's shape, so bad ones would read out of bounds
    check_rope_shapes(x, cos, sin, "qk_norm_rope")
    return _forward(x, scale, temperature, cos, sin)


@_fwd_op.register_fake
def _(x, scale, temperature, cos, sin) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("hydra_kernels::qk_norm_rope_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    temperature: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom ops return tensors only: without a temperature the second output is empty."""
    check_rope_shapes(x, cos, sin, "qk_norm_rope")  # as the forward op
    dx, dtemp = _backward(dy, x, scale, temperature, cos, sin)
    return dx, dtemp if dtemp is not None else x.new_empty(0)


@_bwd_op.register_fake
def _(dy, x, scale, temperature, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), (
        temperature.new_empty(temperature.shape) if temperature is not None else x.new_empty(0)
    )


def _setup(ctx, inputs, output) -> None:
    x, scale, temperature, cos, sin = inputs
    ctx.save_for_backward(x, temperature, cos, sin)
    ctx.scale = scale


def _grads(ctx, dy):
    x, temperature, cos, sin = ctx.saved_tensors
    if getattr(ctx, "eager", False):
        dx, dtemp = _backward(dy, x, ctx.scale, temperature, cos, sin)
    else:
        dx, dtemp = _bwd_op(dy, x, ctx.scale, temperature, cos, sin)
    return dx, None, (dtemp if temperature is not None else None), None, None


_fwd_op.register_autograd(_grads, setup_context=_setup)
_QKNormRopeFunction = eager_autograd_function("_QKNormRopeFunction", _forward, _setup, _grads)


# --- public function -----------------------------------------------------------------------------


def qk_norm_rope(
    x: torch.Tensor, scale: float, temperature: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``rope(qk_norm(x, scale, temperature), cos, sin)`` in one kernel each way.

    ``x`` [B, S, H, D] (any strides that flatten B and S into one); ``temperature`` [H]
    (differentiable) or None; ``cos``/``sin`` [S, R/2] or [B, S, R/2] position tables (no gradient
    on the fused path). The result is a new contiguous tensor in x's dtype. fp64 runs the
    references in fp64.
    """
    check_rope_shapes(x, cos, sin, "qk_norm_rope")
    if temperature is not None and tuple(temperature.shape) != (x.shape[-2],):
        raise ValueError(
            f"qk_norm_rope: temperature has shape {tuple(temperature.shape)} but x has {x.shape[-2]} "
            f"heads (x is {tuple(x.shape)}); pass a [H] tensor"
        )
    check_devices("qk_norm_rope", "x temperature", x, temperature)
    scale = constant_scale("qk_norm_rope", scale)
    if x.dtype == torch.float64:
        return qk_norm_rope_ref(x, scale, temperature, cos, sin)
    tensors = (x, cos, sin) if temperature is None else (x, temperature, cos, sin)
    if (
        x.dtype not in KERNEL_DTYPES
        or not (cos.is_floating_point() and sin.is_floating_point())
        or cos.requires_grad
        or sin.requires_grad
        or not controls.triton_path("qk_norm_rope", *tensors)
    ):  # the two ops, each on its own switch
        return rope(qk_norm(x, scale, temperature), cos, sin)
    if compiling():
        return _fwd_op(x, scale, temperature, cos, sin)
    return eager_apply(_QKNormRopeFunction, x, scale, temperature, cos, sin)
