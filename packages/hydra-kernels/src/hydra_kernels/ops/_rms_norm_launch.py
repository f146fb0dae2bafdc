"""RMSNorm's launch tables and host launchers: ``rms_norm_fwd_launch`` and ``rms_norm_bwd_launch``
run the Triton kernels of ``ops/_rms_norm_kernels.py`` (see ``rms_norm`` for what each does).

Separate from ``ops/rms_norm.py``, which holds the references, the custom ops, the autograd glue
and the public functions, and re-exports the tables and launchers: tests, the bench scripts and
``hydra-kernels status`` read them there, and the implementations behind the custom ops call the
launchers through that module's names (so a test that replaces one there replaces what runs).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hydra_kernels.launch_config import BLACKWELL_TUNING, LaunchConfig
from hydra_kernels.ops._custom_op import (
    WidthTables,
    cdiv,
    device_guard,
    launch_config_for,
    next_power_of_2,
    persistent_grid,
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
