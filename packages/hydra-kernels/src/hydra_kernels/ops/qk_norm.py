"""Per-head L2 normalisation of queries/keys (CCGQA): x · scale / ‖x‖₂ · exp(temperature[h]).

Faces: the PyTorch reference ``qk_norm_ref``, Triton kernels with host launchers, custom ops
``hydra_kernels::qk_norm_fwd`` / ``hydra_kernels::qk_norm_bwd`` (what torch.compile traces), and
the public :func:`qk_norm` choosing between them (:func:`hydra_kernels.controls.triton_path`).

``x`` is ``[..., H, D]`` and may be a strided view (e.g. q sliced out of a packed q|k
projection): the kernels read it through a token stride and a head stride, so no copy is made
unless the last dim itself is strided or the leading dims cannot be flattened into one stride.
Norms and products are fp32; the output has x's dtype; ``temperature`` ([H], learnable) gets its
gradient in its own dtype, summed from fp32 per-program partials. An all-zero head is guarded as
in the reference: ‖x‖ is clamped to :data:`NORM_EPS` (gradient then passes only through the
numerator, as ``clamp_min``'s does).

Kernels (in ``ops/_qk_norm_kernels.py``): ``_qk_norm_fwd_kernel`` normalises ``BLOCK_ROWS``
(token, head) rows per program. ``_qk_norm_bwd_kernel`` is persistent style: it recomputes the
norm from x, writes dx into fresh memory and accumulates each row's Σ dy·y into a per-program [H]
fp32 partial for dtemperature. With ``HALF`` > 0 both also apply RoPE after the norm (forward) and
undo it on dy (backward): ops/qk_norm_rope.py's fused op.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import LaunchConfig
from hydra_kernels.ops._custom_op import (
    WidthTables,
    cdiv,
    check_devices,
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
from hydra_kernels.ops._qk_norm_kernels import _qk_norm_bwd_kernel, _qk_norm_fwd_kernel
from hydra_kernels.ops.rope import rope_kernel_args, rope_plan_key

# Guards the division for an all-zero head; far below any real norm.
NORM_EPS = 1e-6

#: Widest head the kernels hold in registers.
MAX_HEAD_DIM = 4096

# Heads are 64-256 wide: many rows per program so each program moves a few kB. The seed's
# Blackwell tuning (8 warps) targets wide tiles and would leave most lanes idle here, so every
# generation takes the same entries.
_ROWS = {
    64: LaunchConfig(num_warps=4, num_stages=2, block_rows=32),
    128: LaunchConfig(num_warps=4, num_stages=2, block_rows=16),
    256: LaunchConfig(num_warps=4, num_stages=2, block_rows=8),
    1024: LaunchConfig(num_warps=4, num_stages=2, block_rows=4),
    MAX_HEAD_DIM: LaunchConfig(num_warps=8, num_stages=2, block_rows=1),
}
TABLES: WidthTables = tuple(
    (width, {"hopper": cfg, "blackwell": cfg, "default": cfg}) for width, cfg in _ROWS.items()
)
# The backward's row loop prefetches num_stages tiles of x and dy (4 kB each at 16 rows × 128).
BWD_TABLES: WidthTables = tuple(
    (width, {gen: replace(cfg, num_stages=3) for gen, cfg in table.items()}) for width, table in TABLES
)

#: Target programs per SM of the persistent backward (the bench script sweeps it).
BWD_PROGRAMS_PER_SM: dict[str, int] = {"blackwell": 4, "hopper": 4, "ampere": 4, "default": 2}


# --- PyTorch references --------------------------------------------------------------------------


def qk_norm_ref(x: torch.Tensor, scale: float, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``x`` is [..., H, D]; fp32 norms (fp64 for fp64 x); ``temperature`` is [H] or None."""
    xf = upcast(x)
    inv = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(NORM_EPS * NORM_EPS))
    y = xf * inv * scale
    if temperature is not None:
        y = y * upcast(temperature).exp().unsqueeze(-1)
    return y.to(x.dtype)


def qk_norm_backward_ref(
    dy: torch.Tensor, x: torch.Tensor, scale: float, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dtemperature or None) from the saved inputs, in fp32 (fp64 for fp64) PyTorch. Runs
    when the fused backward is switched off or fails."""
    xf, dyf = upcast(x), upcast(dy)
    sq = xf.pow(2).sum(-1, keepdim=True)
    inv = torch.rsqrt(sq.clamp_min(NORM_EPS * NORM_EPS))
    gain = inv * scale
    if temperature is not None:
        gain = gain * upcast(temperature).exp().unsqueeze(-1)
    dot = (dyf * xf).sum(-1, keepdim=True)
    # d/dx of 1/‖x‖ is −x/‖x‖³ where the clamp is inactive, zero where it holds.
    radial = torch.where(sq >= NORM_EPS * NORM_EPS, inv * inv * dot, torch.zeros_like(dot))
    dx = (gain * (dyf - xf * radial)).to(x.dtype)
    if temperature is None:
        return dx, None
    dtemp = (gain * dot).reshape(-1, x.shape[-2]).sum(0).to(temperature.dtype)
    return dx, dtemp


# --- Triton kernels: ops/_qk_norm_kernels.py -----------------------------------------------------


# --- host launchers ------------------------------------------------------------------------------


def _as_token_heads(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [tokens, H, D] with unit stride along D: a view when strides allow, else a copy."""
    heads = t.reshape(-1, t.shape[-2], t.shape[-1])
    return heads if heads.stride(-1) == 1 else heads.contiguous()


def _token_head_strides(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(``t`` or its [tokens, H, D] view/copy, token stride, head stride); no view is made for a
    contiguous ``t`` (host time: see rms_norm's launchers)."""
    if t.is_contiguous():
        return t, t.shape[-2] * t.shape[-1], t.shape[-1]
    t3 = _as_token_heads(t)
    return t3, t3.stride(0), t3.stride(1)


def _block_d(x: torch.Tensor, temperature: torch.Tensor | None, dy: torch.Tensor | None = None) -> int:
    """BLOCK_D for x's heads; raises (→ counted fallback) for what the kernels cannot take, which
    only a direct call of the custom ops can pass (the public function checks shapes first)."""
    head_dim = x.shape[-1]
    if (temperature is not None and temperature.numel() != x.shape[-2]) or (
        dy is not None and dy.shape != x.shape
    ):
        raise ValueError(f"qk_norm: temperature must have {x.shape[-2]} entries and dy x's shape")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"qk_norm: heads of {head_dim} elements exceed the {MAX_HEAD_DIM} the fused kernel holds "
            "in registers; the PyTorch reference runs instead"
        )
    return next_power_of_2(head_dim)


_FWD_PLANS = plan_cache()
_BWD_PLANS = plan_cache()


def _fwd_plan(x: torch.Tensor, temperature: torch.Tensor | None, half: int, key) -> tuple[LaunchPlan, int]:
    n_heads, head_dim = x.shape[-2], x.shape[-1]
    block_d = _block_d(x, temperature)
    n_rows = x.numel() // head_dim
    cfg = launch_config_for("qk_norm", x.device, block_d, TABLES)
    block_rows = min(cfg.block_rows, next_power_of_2(n_rows))
    consts = {"N_HEADS": n_heads, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_ROWS": block_rows,
              "HAS_TEMP": temperature is not None, "HALF": half}  # fmt: skip
    plan = LaunchPlan(
        _qk_norm_fwd_kernel,
        (cdiv(n_rows, block_rows),),
        consts,
        cfg.num_warps,
        cfg.num_stages,
        x.get_device(),
    )
    _FWD_PLANS[key] = (plan, n_rows)
    return _FWD_PLANS[key]


def qk_norm_fwd_launch(
    x: torch.Tensor,
    scale: float,
    temperature: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the forward kernel; the output is contiguous with x's shape and dtype. ``tables``:
    RoPE's (cos, sin), applied to the normed heads in the same kernel (ops/qk_norm_rope.py)."""
    y = empty_like_contiguous(x)
    if x.numel() == 0:
        _block_d(x, temperature)
        return y
    x3, stride_t, stride_h = _token_head_strides(x)
    if temperature is not None and not temperature.is_contiguous():
        temperature = temperature.contiguous()
    rope = rope_kernel_args(x, tables)
    key = (x.shape, stride_t, stride_h, x.dtype, None if temperature is None else (temperature.dtype,
           temperature.numel()), x.get_device(), *rope_plan_key(rope))  # fmt: skip
    plan, n_rows = _FWD_PLANS.get(key) or _fwd_plan(x, temperature, rope[-1], key)
    cos, sin, seq_len, stride_tb, stride_ts, _ = rope
    with device_guard(x):
        plan(x3, x3 if temperature is None else temperature, cos, sin, y, n_rows, stride_t, stride_h, seq_len,
             stride_tb, stride_ts, float(scale), NORM_EPS * NORM_EPS)  # fmt: skip
    return y


def _bwd_plan(x: torch.Tensor, dy: torch.Tensor, temperature: torch.Tensor | None, half: int, key):
    n_heads, head_dim = x.shape[-2], x.shape[-1]
    block_d = _block_d(x, temperature, dy)
    n_rows = x.numel() // head_dim
    cfg = launch_config_for("qk_norm_bwd", x.device, block_d, BWD_TABLES)
    block_rows = min(cfg.block_rows, next_power_of_2(n_rows))
    n_programs, iters = persistent_grid(cdiv(n_rows, block_rows), x.device, BWD_PROGRAMS_PER_SM)
    consts = {"N_HEADS": n_heads, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_ROWS": block_rows,
              "BLOCK_H": next_power_of_2(n_heads), "ITERS": iters, "HAS_TEMP": temperature is not None,
              "LOOP_STAGES": cfg.num_stages, "HALF": half}  # fmt: skip
    plan = LaunchPlan(
        _qk_norm_bwd_kernel, (n_programs,), consts, cfg.num_warps, cfg.num_stages, x.get_device()
    )
    _BWD_PLANS[key] = (plan, n_programs, n_rows)
    return _BWD_PLANS[key]


def qk_norm_bwd_launch(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    temperature: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the backward kernel: (dx, dtemperature or None). With ``tables``, ``dy`` is the
    gradient of the rotated output and is rotated back in the same kernel."""
    dx = empty_like_contiguous(x)
    if x.numel() == 0:
        _block_d(x, temperature, dy)
        return dx, (torch.zeros_like(temperature) if temperature is not None else None)
    x3, stride_xt, stride_xh = _token_head_strides(x)
    dy3, stride_dyt, stride_dyh = _token_head_strides(dy)
    has_temp = temperature is not None
    if has_temp and not temperature.is_contiguous():
        temperature = temperature.contiguous()
    rope = rope_kernel_args(x, tables)
    key = (x.shape, dy.shape, stride_xt, stride_xh, stride_dyt, stride_dyh, x.dtype, dy.dtype,
           (temperature.dtype, temperature.numel()) if has_temp else None, x.get_device(),
           *rope_plan_key(rope))  # fmt: skip
    plan, n_programs, n_rows = _BWD_PLANS.get(key) or _bwd_plan(x, dy, temperature, rope[-1], key)
    cos, sin, seq_len, stride_tb, stride_ts, _ = rope
    partial = torch.empty(
        (n_programs, x.shape[-2]) if has_temp else (1,), dtype=torch.float32, device=x.device
    )
    with device_guard(x):
        plan(dy3, x3, temperature if has_temp else x3, cos, sin, dx, partial, n_rows, stride_dyt,
             stride_dyh, stride_xt, stride_xh, seq_len, stride_tb, stride_ts, float(scale),
             NORM_EPS * NORM_EPS)  # fmt: skip
    if not has_temp:
        return dx, None
    dtemp = partial.sum(0)
    return dx, (dtemp if dtemp.dtype == temperature.dtype else dtemp.to(temperature.dtype))


# --- implementations behind the custom ops (Triton with a counted fallback) ---------------------


def _qk_norm_forward(x: torch.Tensor, scale: float, temperature: torch.Tensor | None) -> torch.Tensor:
    return run_with_fallback(
        "qk_norm",
        lambda: qk_norm_fwd_launch(x, scale, temperature),
        lambda: qk_norm_ref(x, scale, temperature).contiguous(),
    )


def _qk_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, scale: float, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    reference = lambda: qk_norm_backward_ref(dy, x, scale, temperature)
    # The backward switch is read here, at run time, so it holds inside compiled graphs too.
    tensors = (dy, x) if temperature is None else (dy, x, temperature)
    if not controls.triton_path("qk_norm", *tensors, backward=True):
        return reference()
    return run_with_fallback("qk_norm", lambda: qk_norm_bwd_launch(dy, x, scale, temperature), reference)


# --- torch.library registration ------------------------------------------------------------------


@torch.library.custom_op("hydra_kernels::qk_norm_fwd", mutates_args=())
def _qk_norm_fwd_op(x: torch.Tensor, scale: float, temperature: torch.Tensor | None) -> torch.Tensor:
    return _qk_norm_forward(x, scale, temperature)


@_qk_norm_fwd_op.register_fake
def _(x: torch.Tensor, scale: float, temperature: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("hydra_kernels::qk_norm_bwd", mutates_args=())
def _qk_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, scale: float, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom ops return tensors only: without a temperature the second output is empty."""
    dx, dtemp = _qk_norm_backward(dy, x, scale, temperature)
    return dx, dtemp if dtemp is not None else x.new_empty(0)


@_qk_norm_bwd_op.register_fake
def _(
    dy: torch.Tensor, x: torch.Tensor, scale: float, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), (
        temperature.new_empty(temperature.shape) if temperature is not None else x.new_empty(0)
    )


def _qk_norm_setup(ctx, inputs, output) -> None:
    x, scale, temperature = inputs
    ctx.save_for_backward(x, temperature)
    ctx.scale = scale


def _qk_norm_grads(ctx, dy):
    x, temperature = ctx.saved_tensors
    if getattr(ctx, "eager", False):
        dx, dtemp = _qk_norm_backward(dy, x, ctx.scale, temperature)
    else:
        dx, dtemp = _qk_norm_bwd_op(dy, x, ctx.scale, temperature)
    return dx, None, (dtemp if temperature is not None else None)


_qk_norm_fwd_op.register_autograd(_qk_norm_grads, setup_context=_qk_norm_setup)
_QKNormFunction = eager_autograd_function("_QKNormFunction", _qk_norm_forward, _qk_norm_setup, _qk_norm_grads)


# --- public function -----------------------------------------------------------------------------


def constant_scale(op: str, scale: float | torch.Tensor) -> float:
    """``scale`` as the float the kernels take. A tensor that requires grad is refused: made a
    float, it would silently get no gradient (the kernels differentiate x and temperature only)."""
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError(
            f"{op}: scale is a tensor that requires grad, but it is taken as a constant float (no "
            f"gradient); for a learnable scale multiply the result by it: {op}(x, 1.0, ...) * scale"
        )
    return float(scale)


def qk_norm(x: torch.Tensor, scale: float, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """``x / ‖x‖₂ * scale`` per head over the last dim, times ``exp(temperature[h])`` if given.

    ``x`` is [..., H, D] (any strides); ``temperature`` is a [H] tensor (differentiable) or None.
    fp64 inputs run the reference (in fp64).
    """
    if x.dim() < 2:
        raise ValueError(f"qk_norm: x must be [..., H, D], got shape {tuple(x.shape)}")
    if temperature is not None and tuple(temperature.shape) != (x.shape[-2],):
        raise ValueError(
            f"qk_norm: temperature has shape {tuple(temperature.shape)} but x has {x.shape[-2]} heads "
            f"(x is {tuple(x.shape)}); pass a [H] tensor"
        )
    check_devices("qk_norm", "x temperature", x, temperature)
    scale = constant_scale("qk_norm", scale)
    tensors = (x,) if temperature is None else (x, temperature)
    if x.dtype == torch.float64 or not controls.triton_path("qk_norm", *tensors):
        return qk_norm_ref(x, scale, temperature)
    if compiling():
        return _qk_norm_fwd_op(x, scale, temperature)
    return eager_apply(_QKNormFunction, x, scale, temperature)
