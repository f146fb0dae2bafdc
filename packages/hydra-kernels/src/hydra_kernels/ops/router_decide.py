"""One decoded token's causal routing decision (a Mixture-of-Depths point) in one kernel.

Why: at batch 1 a graphed decode step is bound by how many kernels it launches (~4 µs each on an
H100). Done op by op, one routing decision is some twenty tiny kernels — the router's RMS
statistics (pow, mean, rsqrt), its matrix-vector product and affine (mv, addcmul), the sigmoid,
the threshold test, the budget arithmetic (mul, shift, compare, and), the counter update, ``any``
and the copies of the decision into the decoder's held buffers and flag. Here it is one launch.

For each row b of h [B, E] (one decoded token per sequence), with every statistic in fp32:

    logit[b]  = (h[b]·w) · rsqrt(mean(h[b]²) + eps) + bias      (hydra_model's router_logits)
    weight[b] = σ(logit[b])
    budget[b] = ((pos[b] + 1) · cap_q + capacity_one − 1) >> capacity_bits     (⌈cap · (t + 1)⌉)
    taken[b]  = logit[b] > tau  and  count[b] < budget[b]
    count[b] += taken[b]
    flag      = any(taken)

The arithmetic is hydra_model's (causal_routing.py, fused_routing.py); hydra_kernels does not
import hydra_model, so the caller passes the fixed-point capacity and its constants as integers.

Faces: the PyTorch reference :func:`router_decide_ref` (the same ops hydra_model runs unfused),
the Triton kernel ``_router_decide_kernel`` with its launcher :func:`router_decide_launch`, and
:func:`router_decide`, which runs the kernel where hydra_kernels' Triton path is on for the
tensors' device (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere. Every
output is written in place into the caller's buffers and nothing is allocated or read on the host,
so a call can be captured in a CUDA graph (after one eager call has compiled the kernel). No
autograd: this is the decode step's decision (gradients are not tracked through it).
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

#: Widest tile of E one loop iteration loads per row; wider rows loop over E.
MAX_BLOCK_E = 2048
#: Rows held in one tile; more rows loop (decoding batches are small, so usually one tile).
MAX_BLOCK_B = 16


# --- PyTorch reference ---------------------------------------------------------------------------


def router_decide_ref(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    tau: torch.Tensor,
    pos: torch.Tensor,
    count: torch.Tensor,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    eps: float,
    taken: torch.Tensor,
    weight: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """The decision op by op, as hydra_model computes it unfused (see the module docstring); writes
    ``taken`` [B] bool, ``weight`` [B], ``flag`` [] bool and updates ``count`` [B] in place. fp64
    inputs compute in fp64."""
    ct = torch.promote_types(h.dtype, torch.float32)
    hf, wf, bf = h.to(ct), w.to(ct), b.to(ct)  # [B, E], [E], []
    inv = torch.rsqrt(hf.pow(2).mean(-1) + eps)  # [B]
    logit = torch.addcmul(bf, hf @ wf, inv)  # [B]
    budget = ((pos + 1) * cap_q + (capacity_one - 1)) >> capacity_bits  # [B] long
    now = (logit > tau) & (count < budget)  # [B] bool
    count.add_(now.to(count.dtype))
    taken.copy_(now)
    weight.copy_(torch.sigmoid(logit))
    flag.copy_(now.any())


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _router_decide_kernel(
    H, W, BIAS, TAU, POS, COUNT, TAKEN, WEIGHT, FLAG,
    stride_h, stride_h_e, stride_w, stride_pos, stride_count, stride_taken, stride_weight, cap_q, eps,
    N_ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
    CAP_BITS: tl.constexpr, CAP_ONE: tl.constexpr,
):  # fmt: skip
    # One program for every row: the flag is a reduction over rows, and one program makes it a
    # register reduction instead of an atomic on a flag that would first need clearing (a kernel).
    # Trip counts are compile-time constants (the interpreter cannot loop to a run-time bound).
    bias = tl.load(BIAS).to(tl.float32)
    tau = tl.load(TAU).to(tl.float32)
    seen = tl.zeros((BLOCK_B,), dtype=tl.int32)  # per lane: some row it held was taken
    for r0 in tl.range(0, N_ROWS, BLOCK_B):
        rows = r0 + tl.arange(0, BLOCK_B)
        row_mask = rows < N_ROWS
        rows = rows.to(tl.int64)  # row offsets can pass 2**31 in a large strided buffer
        dot = tl.zeros((BLOCK_B,), dtype=tl.float32)
        sq = tl.zeros((BLOCK_B,), dtype=tl.float32)
        for c0 in tl.range(0, DIM, BLOCK_E):  # one read of h feeds both reductions
            cols = c0 + tl.arange(0, BLOCK_E)
            col_mask = cols < DIM
            mask = row_mask[:, None] & col_mask[None, :]
            # E's strides are 1 but for odd layouts; Triton specialises 1 at launch, so unit-stride
            # calls compile to the same contiguous loads as without them (int64: a strided E can
            # span more than 2**31 elements too)
            cols64 = cols.to(tl.int64)
            x = tl.load(H + rows[:, None] * stride_h + cols64[None, :] * stride_h_e, mask=mask, other=0.0)
            w = tl.load(W + cols64 * stride_w, mask=col_mask, other=0.0).to(tl.float32)
            x = x.to(tl.float32)
            dot += tl.sum(x * w[None, :], axis=1)
            sq += tl.sum(x * x, axis=1)
        logit = dot * tl.rsqrt(sq / DIM + eps) + bias  # [BLOCK_B]
        pos = tl.load(POS + rows * stride_pos, mask=row_mask, other=0).to(tl.int64)
        prev = tl.load(COUNT + rows * stride_count, mask=row_mask, other=0)
        budget = ((pos + 1) * cap_q + (CAP_ONE - 1)) >> CAP_BITS
        taken = (logit > tau) & (prev < budget) & row_mask
        tl.store(COUNT + rows * stride_count, prev + taken.to(prev.dtype), mask=row_mask)
        tl.store(TAKEN + rows * stride_taken, taken, mask=row_mask)
        tl.store(WEIGHT + rows * stride_weight, tl.sigmoid(logit), mask=row_mask)
        seen = seen | taken.to(tl.int32)
    tl.store(FLAG, tl.max(seen, axis=0) > 0)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def _check(h, w, b, tau, pos, count, taken, weight, flag) -> None:
    """Shapes and dtypes the kernel relies on; raises ValueError (a caller's mistake, not a kernel
    fault, so the public function raises it too rather than falling back)."""
    if h.dim() != 2:
        raise ValueError(f"router_decide: h must be [B, E], got {tuple(h.shape)}")
    n, e = h.shape
    if w.shape != (e,) or b.dim() != 0 or tau.dim() != 0 or flag.dim() != 0:
        raise ValueError(
            f"router_decide: w must be [{e}], b, tau and flag 0-d; got w {tuple(w.shape)}, b "
            f"{tuple(b.shape)}, tau {tuple(tau.shape)}, flag {tuple(flag.shape)}"
        )
    for name, t in (("pos", pos), ("count", count), ("taken", taken), ("weight", weight)):
        if t.shape != (n,):
            raise ValueError(f"router_decide: {name} must be [{n}], got {tuple(t.shape)}")
    if pos.dtype != torch.long or count.dtype != torch.long:
        raise ValueError(f"router_decide: pos and count must be int64, got {pos.dtype}, {count.dtype}")
    if taken.dtype != torch.bool or flag.dtype != torch.bool:
        raise ValueError(f"router_decide: taken and flag must be bool, got {taken.dtype}, {flag.dtype}")
    names = "h w b tau pos count taken weight flag"
    check_devices("router_decide", names, h, w, b, tau, pos, count, taken, weight, flag)


def router_decide_launch(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    tau: torch.Tensor,
    pos: torch.Tensor,
    count: torch.Tensor,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    eps: float,
    taken: torch.Tensor,
    weight: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """Launch the kernel (arguments as :func:`router_decide`). Every tensor is read at its own
    strides (h's along both dimensions, w's too): a copy into a contiguous one would allocate
    inside a captured decode step, and refusing them made a layout the kernel reads at no cost a
    counted fallback to the reference."""
    n, e = h.shape
    if n == 0:  # nothing decided; the flag still says so
        flag.fill_(False)
        return
    # Triton specialises integer arguments (1, multiples of 16), so the plan is keyed by them all.
    strides = (h.stride(0), h.stride(1), w.stride(0), pos.stride(0), count.stride(0), taken.stride(0),
               weight.stride(0))  # fmt: skip
    key = (n, e, strides, cap_q, capacity_bits, capacity_one, h.dtype, w.dtype, b.dtype, tau.dtype,
           weight.dtype, h.get_device())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        block_e = min(next_power_of_2(e), MAX_BLOCK_E)
        block_b = min(next_power_of_2(n), MAX_BLOCK_B)
        consts = {"N_ROWS": n, "DIM": e, "BLOCK_B": block_b, "BLOCK_E": block_e,
                  "CAP_BITS": capacity_bits, "CAP_ONE": capacity_one}  # fmt: skip
        # a tile of BLOCK_B × BLOCK_E fp32 values: 4 warps for up to 4K of them, 8 beyond
        warps = 4 if block_b * block_e <= 4096 else 8
        plan = _PLANS[key] = LaunchPlan(_router_decide_kernel, (1,), consts, warps, 1, h.get_device())
    with device_guard(h):
        plan(h, w, b, tau, pos, count, taken, weight, flag, *strides, int(cap_q), float(eps))


# --- public function -----------------------------------------------------------------------------


def router_decide(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    tau: torch.Tensor,
    pos: torch.Tensor,
    count: torch.Tensor,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    eps: float,
    taken: torch.Tensor,
    weight: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """One decoded token per row's routing decision, written in place (see the module docstring).

    h [B, E] (bf16/fp16/fp32; any strides), w [E] (any stride), b [] and tau [] (any float dtype, read
    as fp32), pos [B] and count [B] int64 (count advances where taken), ``cap_q`` the point's
    fixed-point capacity out of ``capacity_one`` = 2**``capacity_bits``, ``eps`` the norm's.
    Outputs: taken [B] bool, weight [B] = σ(logit) (fp32), flag [] bool = any(taken). The Triton
    kernel runs where hydra_kernels' Triton path is on for h's device; fp64 h, a switched-off
    path or another device run :func:`router_decide_ref`.
    """
    _check(h, w, b, tau, pos, count, taken, weight, flag)
    args = (h, w, b, tau, pos, count, cap_q, capacity_bits, capacity_one, eps, taken, weight, flag)
    if not (h.dtype in KERNEL_DTYPES and controls.triton_path("router_decide", h)):
        router_decide_ref(*args)
        return
    # a launch fails before the kernel runs (compilation, argument binding), so count is still
    # untouched and the reference can decide instead (counted: controls.fallback_counts())
    run_with_fallback("router_decide", lambda: router_decide_launch(*args), lambda: router_decide_ref(*args))
