"""A routed block's gated residual update, written into the stream in place (no autograd).

Why: after a Mixture-of-Depths block ran on the rows it took, a forward without gradients (a
prompt's prefill, an evaluation forward, a decode step) adds each taken row's update
``σ(logit)·(out − in)`` to the residual stream op by op in hydra_model (routing_causal.py): the
difference, the product, the cast, a masked select against zeros and the add or ``index_add``,
seven launches a routing point at batch 1, where a prefill and the capture of a decode step are
bound by host launches. Here it is one (and a copy of the stream where the caller must keep it).

For each row j of ``out`` [M, E] with ``take[j]`` set (every row when ``take`` is None), the row
r = ``index[j]`` of ``h`` [N, E] (r = j when ``index`` is None) becomes

    d = round(out[j] − h[r]);  u = round(weight[r] · d);  h[r] = round(h[r] + u)

with ``round`` to h's dtype and the product in fp32 (weight is fp32): the roundings of the op-by-op
form (``(w * (out − h)).to(h.dtype)`` then ``h + u``), so both give the same bits. Rows not taken
are left as they are (bit for bit: the op-by-op form adds a zero to them, which turns a −0.0 into
+0.0, the one difference); the taken rows' indices must be distinct.

Faces: the PyTorch reference :func:`gated_update_ref_`, the Triton kernel ``_gated_update_kernel``
(one row a program, E in tiles) with its launcher :func:`gated_update_launch`, and
:func:`gated_update_`, which runs the kernel where hydra_kernels' Triton path is on for h's device
(CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    check_devices,
    device_guard,
    next_power_of_2,
    run_with_fallback,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Widest tile of E one loop iteration loads.
MAX_BLOCK_E = 1024


# --- PyTorch reference ---------------------------------------------------------------------------


def gated_update_ref_(
    h: torch.Tensor,
    out: torch.Tensor,
    weight: torch.Tensor,
    take: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update op by op (see the module docstring), in place on ``h``; returns h. Shapes
    stay static (a row not taken adds zeros): it also runs on fake tensors (FLOP counting)."""
    rows = torch.arange(out.shape[0], device=h.device) if index is None else index.long()
    update = weight[rows].unsqueeze(-1) * (out - h[rows])
    if take is not None:
        update = torch.where(take.unsqueeze(-1), update, torch.zeros_like(update))
    return h.index_add_(0, rows, update.to(h.dtype))


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _rounded(x, dt: tl.constexpr, BF16: tl.constexpr):
    """fp32 x rounded to dt (to nearest, ties to even), returned in fp32. For bf16 the rounding is
    done on the bits: Triton's CPU interpreter truncates a float32 → bfloat16 cast, and the tests
    compare bits there too; on a GPU both ways give the same."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN as it is
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _gated_update_kernel(
    H, OUT, W, TAKE, IDX, stride_h, stride_o,
    DIM: tl.constexpr, BLOCK_E: tl.constexpr, HAS_TAKE: tl.constexpr, HAS_INDEX: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64)
    taken = True
    if HAS_TAKE:
        taken = tl.load(TAKE + j) != 0
    r = j
    if HAS_INDEX:
        r = tl.load(IDX + j).to(tl.int64)
    w = tl.load(W + r, mask=taken, other=0.0).to(tl.float32)
    dt: tl.constexpr = H.dtype.element_ty
    for c0 in tl.range(0, DIM, BLOCK_E):
        cols = c0 + tl.arange(0, BLOCK_E)
        mask = (cols < DIM) & taken
        base = tl.load(H + r * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(OUT + j * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
        d = _rounded(o - base, dt, BF16)  # the difference in h's dtype, as the eager sub
        u = _rounded(w * d, dt, BF16)  # the fp32 product, cast as the eager .to(h.dtype)
        tl.store(H + r * stride_h + cols, _rounded(base + u, dt, BF16).to(dt), mask=mask)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def gated_update_launch(
    h: torch.Tensor,
    out: torch.Tensor,
    weight: torch.Tensor,
    take: torch.Tensor | None,
    index: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the kernel (arguments as :func:`gated_update_`, already checked): rows of h and out
    with unit stride along E, weight, take and index contiguous."""
    m, e = out.shape
    if m == 0:
        return h
    has_take, has_index = take is not None, index is not None
    index_dtype = index.dtype if has_index else None  # the kernel reads it at its own width
    key = (m, e, h.stride(0), out.stride(0), h.dtype, out.dtype, has_take, index_dtype, h.get_device())
    plan = _PLANS.get(key)
    if plan is None:
        block_e = min(next_power_of_2(e), MAX_BLOCK_E)
        consts = {"DIM": e, "BLOCK_E": block_e, "HAS_TAKE": has_take, "HAS_INDEX": has_index,
                  "BF16": h.dtype == torch.bfloat16}  # fmt: skip
        # no fused multiply-add: the eager form rounds the product before the add
        options = {"enable_fp_fusion": False}
        plan = _PLANS[key] = LaunchPlan(_gated_update_kernel, (m,), consts, 4, 1, h.get_device(), options)
    # an absent take or index: any pointer, never read (its branch is compiled out)
    take_arg = take.view(torch.uint8) if has_take else weight
    with device_guard(h):
        plan(h, out, weight, take_arg, index if has_index else weight, h.stride(0), out.stride(0))
    return h


# --- public function -----------------------------------------------------------------------------


def gated_update_(
    h: torch.Tensor,
    out: torch.Tensor,
    weight: torch.Tensor,
    take: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [N, E] with each taken row's gated update added in place (see the module docstring);
    returns h. ``out`` [M, E] in h's dtype; ``weight`` [N] fp32, per row of h; ``take`` [M] bool or
    None (all); ``index`` [M] integer rows of h, distinct where taken, or None (row j, M ≤ N). The
    Triton kernel runs where hydra_kernels' Triton path is on for h's device; fp64, a
    switched-off path or another device run :func:`gated_update_ref_`. No autograd."""
    if h.dim() != 2 or out.dim() != 2 or out.shape[1] != h.shape[1] or out.dtype != h.dtype:
        raise ValueError(
            f"gated_update_: h [N, E] and out [M, E] of one dtype; got h {tuple(h.shape)} {h.dtype}, "
            f"out {tuple(out.shape)} {out.dtype}"
        )
    m = out.shape[0]
    if weight.shape != (h.shape[0],) or weight.dtype != torch.float32:
        raise ValueError(f"gated_update_: weight must be [N] = [{h.shape[0]}] fp32, got "
                         f"{tuple(weight.shape)} {weight.dtype}")  # fmt: skip
    if take is not None and (take.shape != (m,) or take.dtype != torch.bool):
        raise ValueError(f"gated_update_: take must be [M] = [{m}] bool, got {tuple(take.shape)} "
                         f"{take.dtype}")  # fmt: skip
    if index is None and m > h.shape[0]:
        raise ValueError(f"gated_update_: without an index, out's {m} rows must not exceed h's {h.shape[0]}")
    if index is not None and (index.shape != (m,) or index.is_floating_point()):
        raise ValueError(f"gated_update_: index must be [M] = [{m}] integers, got {tuple(index.shape)}")
    check_devices("gated_update_", "h out weight take index", h, out, weight, take, index)
    kernel = h.dtype in KERNEL_DTYPES and controls.triton_path("gated_update", h, out, weight)
    if not kernel or h.stride(1) != 1 or out.stride(1) != 1:
        return gated_update_ref_(h, out, weight, take, index)
    weight = weight.contiguous()
    take = None if take is None else take.contiguous()
    index = None if index is None else index.contiguous()
    return run_with_fallback("gated_update", lambda: gated_update_launch(h, out, weight, take, index),
                             lambda: gated_update_ref_(h, out, weight, take, index))  # fmt: skip
