"""A linear router's logits on the RMS-normalised stream, every token's in one kernel (no autograd).

Why: a forward without gradients (evaluation, a prompt's prefill) computes each routing point's
logits op by op in hydra_model (fused_routing.py's eager form): the casts to fp32, the square,
the mean, the epsilon, the rsqrt, the matrix-vector product and the affine — nine launches, at
batch 1 nine host launches of ~25 µs each for a few µs of GPU work. Here it is one.

For each row r of h [R, E], every statistic in fp32 (the arithmetic of hydra_model's
``router_logits`` and of ``router_decide``, which a decode step uses):

    logit[r] = (h[r]·w) · rsqrt(mean(h[r]²) + eps) + bias

Faces: the PyTorch reference :func:`router_logit_ref`, the Triton kernel ``_router_logit_kernel``
(a block of rows per program, E looped in tiles) with its launcher :func:`router_logit_launch`,
and :func:`router_logit`, which runs the kernel where hydra_kernels' Triton path is on for h's
device (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    cdiv,
    check_devices,
    device_guard,
    next_power_of_2,
    run_with_fallback,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Widest tile of E one loop iteration loads per row.
MAX_BLOCK_E = 1024
#: Rows one program computes.
BLOCK_R = 16


# --- PyTorch reference ---------------------------------------------------------------------------


def router_logit_ref(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """[R] logits in fp32 (fp64 for fp64 h), op by op (see the module docstring); outside any
    autocast region, whose matmul would run the product in half precision."""
    ct = torch.promote_types(h.dtype, torch.float32)
    with torch.autocast(h.device.type, enabled=False):
        hf = h.to(ct)
        inv = torch.rsqrt(hf.pow(2).mean(-1) + eps)
        return torch.addcmul(b.to(ct), hf @ w.to(ct), inv)


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _router_logit_kernel(
    H, W, BIAS, OUT, stride_h, eps,
    N_ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N_ROWS
    rows = rows.to(tl.int64)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in tl.range(0, DIM, BLOCK_E):  # one read of h feeds both reductions
        cols = c0 + tl.arange(0, BLOCK_E)
        col_mask = cols < DIM
        x = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dot += tl.sum(x * w[None, :], axis=1)
        sq += tl.sum(x * x, axis=1)
    logit = dot * tl.rsqrt(sq / DIM + eps) + tl.load(BIAS).to(tl.float32)
    tl.store(OUT + rows, logit, mask=row_mask)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def router_logit_launch(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch the kernel (arguments as :func:`router_logit`); h's rows may be strided, each row
    and w contiguous."""
    if h.stride(1) != 1 or w.stride(0) != 1:
        raise ValueError("router_logit: h's rows and w must have unit stride along E")
    n, e = h.shape
    out = torch.empty(n, dtype=torch.float32, device=h.device)
    if n == 0:
        return out
    key = (n, e, h.stride(0), h.dtype, w.dtype, b.dtype, h.get_device())
    plan = _PLANS.get(key)
    if plan is None:
        block_e = min(next_power_of_2(e), MAX_BLOCK_E)
        consts = {"N_ROWS": n, "DIM": e, "BLOCK_R": BLOCK_R, "BLOCK_E": block_e}
        grid = (cdiv(n, BLOCK_R),)
        plan = _PLANS[key] = LaunchPlan(_router_logit_kernel, grid, consts, 4, 1, h.get_device())
    with device_guard(h):
        plan(h, w, b, out, h.stride(0), float(eps))
    return out


# --- public function -----------------------------------------------------------------------------


def router_logit(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Router logits [R] (fp32) for h [R, E] (bf16/fp16/fp32; rows may be strided), w [E] and
    b [] in any float dtype: ``(h·w)·rsqrt(mean(h²) + eps) + b``. The Triton kernel runs where
    hydra_kernels' Triton path is on for h's device; fp64 h, a switched-off path or another
    device run :func:`router_logit_ref`. No autograd."""
    if h.dim() != 2 or w.shape != (h.shape[1],) or b.dim() != 0:
        raise ValueError(f"router_logit: h [R, E], w [E], b []; got {tuple(h.shape)}, {tuple(w.shape)}, "
                         f"{tuple(b.shape)}")  # fmt: skip
    check_devices("router_logit", "h w b", h, w, b)
    if h.shape[1] and h.stride(1) != 1:
        h = h.contiguous()
    if not (h.dtype in KERNEL_DTYPES and controls.triton_path("router_logit", h)):
        return router_logit_ref(h, w, b, eps)
    w = w.contiguous()
    return run_with_fallback("router_logit", lambda: router_logit_launch(h, w, b, eps),
                             lambda: router_logit_ref(h, w, b, eps))  # fmt: skip
