"""Rotary position embedding, NeoX rotate-half, on the first R channels of each head.

``x`` is ``[B, S, H, D]`` (any strides with a unit last one, e.g. q or k sliced out of a fused
projection), ``cos``/``sin`` are ``[S, R/2]`` shared by the batch or ``[B, S, R/2]`` per sequence
(tokens routed out of order keep their original positions). With ``x1 = x[..., :R/2]`` and
``x2 = x[..., R/2:R]`` the output is ``x1·cos − x2·sin`` and ``x2·cos + x1·sin``; channels from R
on are copied. The backward is the inverse rotation (``sin`` negated) of the incoming gradient, so
one kernel with a sign serves both directions.

The kernel walks rows of ``x`` (one row = one head of one token, ``B·S·H`` rows), several rows
per program; each row's position indexes the cos/sin tables, which stay in cache across the heads
that share them.
"""

import torch
import triton
import triton.language as tl

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
    to_output_dtype,
)
from hydra_kernels.ops._launch import LaunchPlan, empty_like_contiguous, plan_cache

#: Per-generation launch table: ``block_rows`` head-rows per program, ``num_warps``. Blackwell
#: takes the seed tuning's warps and stages (its BLOCK_Q/BLOCK_KV attention tiles do not apply).
LAUNCH_DEFAULTS: dict[str, LaunchConfig] = {
    "blackwell": LaunchConfig(num_warps=8, num_stages=3, block_rows=32),
    "hopper": LaunchConfig(num_warps=4, num_stages=1, block_rows=32),
    "ampere": LaunchConfig(num_warps=4, num_stages=1, block_rows=16),
    "default": LaunchConfig(num_warps=4, num_stages=1, block_rows=16),
}


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    n_heads,
    seq_len,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_tb,
    stride_ts,
    SIGN: tl.constexpr,
    HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    head = rows % n_heads
    pos = rows // n_heads
    s = (pos % seq_len).to(tl.int64)
    b = (pos // seq_len).to(tl.int64)
    x_row = (b * stride_xb + s * stride_xs + head.to(tl.int64) * stride_xh)[:, None]
    t_row = (b * stride_tb + s * stride_ts)[:, None]
    o_row = (rows.to(tl.int64) * (2 * HALF + REST))[:, None]  # out is contiguous

    cols = tl.arange(0, BLOCK_HALF)[None, :]
    m = row_ok[:, None] & (cols < HALF)
    x1 = tl.load(x_ptr + x_row + cols, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + HALF + cols, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t_row + cols, mask=m, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t_row + cols, mask=m, other=0.0).to(tl.float32) * SIGN
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_row + cols, to_output_dtype(x1 * c - x2 * sn, dt), mask=m)
    tl.store(out_ptr + o_row + HALF + cols, to_output_dtype(x2 * c + x1 * sn, dt), mask=m)
    if REST > 0:
        rcols = tl.arange(0, BLOCK_REST)[None, :]
        mr = row_ok[:, None] & (rcols < REST)
        v = tl.load(x_ptr + x_row + 2 * HALF + rcols, mask=mr, other=0.0)
        tl.store(out_ptr + o_row + 2 * HALF + rcols, v, mask=mr)


@triton.jit
def rope_operands(COS, SIN, token, seq_len, stride_tb, stride_ts, row_mask, cols, HALF: tl.constexpr):
    """For a kernel that holds whole rows (ops/_qk_norm_kernels.py with RoPE fused): each column's
    rotate-half partner, the cos and sin of its token's position (cos 1 and sin 0 past the rotated
    width R = 2·HALF), and the first-half and rotated column masks."""
    first = cols < HALF
    rotated = cols < 2 * HALF
    partner = tl.where(first, cols + HALF, tl.where(rotated, cols - HALF, cols))
    t_row = (token // seq_len).to(tl.int64) * stride_tb + (token % seq_len).to(tl.int64) * stride_ts
    t_mask = row_mask[:, None] & rotated[None, :]
    t_off = t_row[:, None] + tl.where(first, cols, cols - HALF)[None, :]
    c = tl.load(COS + t_off, mask=t_mask, other=1.0).to(tl.float32)
    s = tl.load(SIN + t_off, mask=t_mask, other=0.0).to(tl.float32)
    return partner, c, s, first[None, :], rotated[None, :]


@triton.jit
def rotate_half(v, vp, c, s, first, rotated):
    """``_rope_kernel``'s rotate-half on whole rows (v and its partners vp), written as that
    kernel's (and kv_decode's) expressions are, so that a fused caller rounds as they do."""
    return tl.where(first, v * c - vp * s, tl.where(rotated, v * c + vp * s, v))


# --- references ------------------------------------------------------------------------------


def _broadcast_table(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [S, R/2] -> [1, S, 1, R/2]; [B, S, R/2] (per-sequence positions) -> [B, S, 1, R/2]
    cd = torch.promote_types(x.dtype, torch.float32)
    return (t.unsqueeze(0) if t.dim() == 2 else t).unsqueeze(2).to(cd)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: ``x`` [B, S, H, D]; ``cos``/``sin`` [S, R/2] or [B, S, R/2] with even R ≤ D.
    Math in fp32 (fp64 for fp64 ``x``), result in ``x``'s dtype; differentiable in all three."""
    half = cos.shape[-1]
    rot = 2 * half
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
    c, s = _broadcast_table(cos, x), _broadcast_table(sin, x)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return rope_ref(x, cos, -sin if inverse else sin).contiguous()


# --- host launcher ---------------------------------------------------------------------------


_PLANS = plan_cache()


#: RoPE tables as the kernels take them (``_rope_kernel``, and those using :func:`rope_operands`):
#: (cos, sin, seq_len, table batch stride, table position stride, HALF); HALF = 0 (and x itself
#: for the pointers): no rotation
RopeKernelArgs = tuple[torch.Tensor, torch.Tensor, int, int, int, int]


def rope_kernel_args(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor] | None) -> RopeKernelArgs:
    """Tables ``(cos, sin)``, [S, R/2] or [B, S, R/2] for x [B, S, H, D] (the caller checks the
    shapes), as kernel arguments; one stride set serves both tables (non-matching or channel-strided
    tables are copied)."""
    if tables is None:
        return x, x, 1, 0, 0, 0
    cos, sin = tables
    cs = cos.stride()
    if cs[-1] != 1 or cs != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
        cs = cos.stride()
    stride_tb, stride_ts = (0, cs[0]) if len(cs) == 2 else (cs[0], cs[1])
    return cos, sin, x.shape[-3], stride_tb, stride_ts, cos.shape[-1]


def rope_plan_key(rope: RopeKernelArgs) -> tuple:
    """What a fused caller's launch-plan key needs of the tables (nothing without a rotation)."""
    cos, sin, seq_len, stride_tb, stride_ts, half = rope
    return (half, seq_len, stride_tb, stride_ts, cos.dtype, sin.dtype) if half else ()


def _plan(x: torch.Tensor, cos: torch.Tensor, inverse: bool, key) -> LaunchPlan:
    bsz, seq, heads, dim = x.shape
    half = cos.shape[-1]
    cfg = resolve_launch_config("rope", x.device, LAUNCH_DEFAULTS)
    block_rows = cfg.block_rows
    if block_rows & (block_rows - 1):
        raise ValueError(f"rope block_rows must be a power of two, got {block_rows}")
    rest = dim - 2 * half
    consts = {
        "SIGN": -1.0 if inverse else 1.0,
        "HALF": half,
        "REST": rest,
        "BLOCK_ROWS": block_rows,
        "BLOCK_HALF": next_power_of_2(half),
        "BLOCK_REST": next_power_of_2(rest),
    }
    grid = (cdiv(bsz * seq * heads, block_rows),)
    _PLANS[key] = LaunchPlan(_rope_kernel, grid, consts, cfg.num_warps, cfg.num_stages, x.get_device())
    return _PLANS[key]


def _launch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotate ``x`` (or undo the rotation when ``inverse``) into a new contiguous tensor."""
    out = empty_like_contiguous(x)
    if x.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin, _, stride_tb, stride_ts, _ = rope_kernel_args(x, (cos, sin))  # one stride set for both
    xs = x.stride()
    key = (x.shape, xs, cos.shape, cos.stride(), x.dtype, cos.dtype, sin.dtype, inverse, x.get_device())
    plan = _PLANS.get(key) or _plan(x, cos, inverse, key)
    bsz, seq, heads, _ = x.shape
    with device_guard(x):
        plan(x, cos, sin, out, bsz * seq * heads, heads, seq, xs[0], xs[1], xs[2], stride_tb, stride_ts)
    return out


# --- torch.library op: opaque to torch.compile, autograd attached ----------------------------
# _rope_impl runs the kernel; one that raises is counted and answered by the reference. Compiled
# code calls it through the custom op, eager code through a plain autograd.Function.


def _rope_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return run_with_fallback(
        "rope",
        lambda: _launch_rope(x, cos, sin, inverse),
        lambda: _rotate_ref(x, cos, sin, inverse),
    )


@torch.library.custom_op("hydra_kernels::rope_rotate", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return _rope_impl(x, cos, sin, inverse)


@_rope_op.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup_context(ctx, inputs, output) -> None:
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _rope_backward(ctx, grad_out: torch.Tensor):
    cos, sin = ctx.saved_tensors
    # The rotation is orthogonal: its gradient is the opposite rotation of the gradient.
    if triton_path("rope", grad_out, cos, sin, backward=True):
        if getattr(ctx, "eager", False):
            grad_x = _rope_impl(grad_out, cos, sin, not ctx.inverse)
        else:
            grad_x = _rope_op(grad_out, cos, sin, not ctx.inverse)
    else:
        grad_x = _rotate_ref(grad_out, cos, sin, not ctx.inverse)
    return grad_x, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)
_RopeEager = eager_autograd_function("RopeEager", _rope_impl, _rope_setup_context, _rope_backward)


# --- public function -------------------------------------------------------------------------


def check_rope_shapes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, op: str = "rope") -> None:
    """Raise ValueError unless x is [B, S, H, D] and cos/sin are [S, R/2] or [B, S, R/2] with R ≤ D,
    on x's device (rope's shapes; qk_norm_rope's too, which passes its name as ``op``)."""
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be [B, S, H, D], got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    bsz, seq, _, dim = x.shape
    if cos.dim() not in (2, 3) or cos.shape[-2] != seq or (cos.dim() == 3 and cos.shape[0] != bsz):
        raise ValueError(
            f"{op}: cos/sin must be [S, R/2] or [B, S, R/2] with B={bsz}, S={seq} from x "
            f"{tuple(x.shape)}; got {tuple(cos.shape)} (slice a longer cache to the first S rows)"
        )
    if 2 * cos.shape[-1] > dim:
        raise ValueError(f"{op}: rotary width R = 2·{cos.shape[-1]} exceeds the head dim D={dim} of x")
    check_devices(op, "x cos sin", x, cos, sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` channels of every head of ``x``; the rest pass
    through unchanged. ``x`` [B, S, H, D]; ``cos``/``sin`` [S, R/2] or [B, S, R/2].

    The result is a new contiguous tensor in ``x``'s dtype (math in fp32). Gradients flow to
    ``x`` only: cos/sin are position buffers. If either of them requires grad, the call runs
    the PyTorch reference instead, which is differentiable in them too.
    """
    check_rope_shapes(x, cos, sin)
    if (
        x.dtype in KERNEL_DTYPES
        and cos.is_floating_point()
        and sin.is_floating_point()
        and not (cos.requires_grad or sin.requires_grad)
        and triton_path("rope", x, cos, sin)
    ):
        return _rope_op(x, cos, sin, False) if compiling() else eager_apply(_RopeEager, x, cos, sin, False)
    return rope_ref(x, cos, sin)
