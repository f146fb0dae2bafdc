"""A whole sequence's causal capacity routing (a Mixture-of-Depths or -Recursions point) and the
gather indices of the tokens it takes, in one kernel.

Why: at batch 1 an eager prefill is bound by its host launches (about 25 µs each on the H100
host of packages/hydra-model/BENCHMARKS.md). Done op by op, one routing point's selection is
some twenty-five small kernels — the threshold test, the budget arithmetic, a cumsum, a cummax,
a cummin, the count, the "taken first" sort keys, a top-k, the member mask, the positions'
gather and the flat row indices. Here it is one launch per point.

For each row b of the router logits [B, n] (hydra_model's causal_routing.py, which this
restates: hydra_kernels does not import hydra_model):

    p(t)      = logit(t) > tau  and  candidate(t)
    budget(t) = ((pos(t) + 1) · cap_q + one − 1) >> bits, made non-decreasing (a running max)
    C(t)      = min(C(t−1) + p(t), budget(t)),  C(−1) = 0      (tokens taken so far)
    taken(t)  = C(t) > C(t−1)

computed in closed form, C = S + min(0, running min of (budget − S)) with S the running sum of
p, once on the row and once on the row shifted by one (which gives C(t−1)). The taken tokens then
go first, in time order, followed by the untaken ones, and the first k form the gather:

    idx [B, k], member [B, k] (j < count), pos_k [B, k] = pos at idx, flat [B·k] = b·n + idx,
    count [B] = tokens taken, taken [B, n]

Faces: the PyTorch reference :func:`causal_select_ref` (the rule hydra_model runs unfused, its
order found by a sort here where hydra_model's ``take_first_k`` scatters),
the Triton kernel ``_causal_select_kernel`` (one program per row, the row in registers) with its
launcher :func:`causal_select_launch`, and :func:`causal_select`, which runs the kernel where
hydra_kernels' Triton path is on for the logits' device (CUDA, or the CPU under
``TRITON_INTERPRET=1``) and rows fit MAX_ROW, and the reference elsewhere. Nothing is read on the
host. No autograd: decisions are integers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import check_devices, device_guard, next_power_of_2, run_with_fallback
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Longest row one program holds in registers; longer rows run the reference.
MAX_ROW = 8192


# --- PyTorch reference ---------------------------------------------------------------------------


def causal_select_ref(
    logit: torch.Tensor,
    tau: torch.Tensor,
    candidates: torch.Tensor | None,
    pos: torch.Tensor | None,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    k: int,
) -> tuple[torch.Tensor, ...]:
    """(taken [B, n] bool, idx [B, k], member [B, k] bool, pos_k [B, k], flat [B·k], count [B])
    op by op (see the module docstring); ``pos`` None means positions 0..n−1."""
    b, n = logit.shape
    if pos is None:
        pos = torch.arange(n, device=logit.device).expand(b, n)
    passed = logit > tau
    if candidates is not None:
        passed = passed & candidates
    budget = (((pos + 1) * cap_q + (capacity_one - 1)) >> capacity_bits).cummax(-1).values
    s = passed.long().cumsum(-1)
    count = s + (budget - s).cummin(-1).values.clamp(max=0)
    taken = count > F.pad(count[:, :-1], (1, 0))
    t = torch.arange(n, device=logit.device)
    key = torch.where(taken, t, t + n)  # distinct: taken first, both parts in time order
    idx = key.topk(k, dim=-1, largest=False, sorted=True).indices if k < n else key.argsort(dim=-1)
    total = taken.sum(dim=1)
    member = torch.arange(k, device=logit.device).unsqueeze(0) < total.unsqueeze(1)
    flat = (idx + torch.arange(b, device=logit.device).unsqueeze(1) * n).reshape(-1)
    return taken, idx, member, pos.gather(1, idx), flat, total


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit
def _taken_so_far(p, budget):
    """C for passes p and budgets (int64 rows): S + min(0, running min of (running max of budget − S))."""
    s = tl.cumsum(p, axis=0)
    bmax = tl.associative_scan(budget, 0, _max_fn)
    return s + tl.minimum(tl.associative_scan(bmax - s, 0, _min_fn), 0)


@triton.jit
def _causal_select_kernel(
    LOGIT, TAU, CAND, POS, TAKEN, IDX, MEMBER, POS_K, FLAT, COUNT,
    stride_l, stride_c, stride_p, cap_q,
    N: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, CAP_BITS: tl.constexpr, CAP_ONE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    tau = tl.load(TAU).to(tl.float32)
    t = tl.arange(0, BLOCK)
    prev = t - 1  # the row shifted by one: its C is C(t − 1)
    here, back = t < N, (prev >= 0) & (t < N)
    p = (tl.load(LOGIT + row * stride_l + t, mask=here, other=0.0).to(tl.float32) > tau) & here
    p_back = (tl.load(LOGIT + row * stride_l + prev, mask=back, other=0.0).to(tl.float32) > tau) & back
    if HAS_CAND:
        p = p & (tl.load(CAND + row * stride_c + t, mask=here, other=0) != 0)
        p_back = p_back & (tl.load(CAND + row * stride_c + prev, mask=back, other=0) != 0)
    if HAS_POS:
        pos = tl.load(POS + row * stride_p + t, mask=here, other=0).to(tl.int64)
        pos_back = tl.load(POS + row * stride_p + prev, mask=back, other=0).to(tl.int64)
    else:
        pos = t.to(tl.int64)
        pos_back = prev.to(tl.int64)
    budget = tl.where(here, ((pos + 1) * cap_q + (CAP_ONE - 1)) >> CAP_BITS, 0)
    budget_back = tl.where(back, ((pos_back + 1) * cap_q + (CAP_ONE - 1)) >> CAP_BITS, 0)
    now = _taken_so_far(p.to(tl.int64), budget)
    before = _taken_so_far(p_back.to(tl.int64), budget_back)
    taken = (now > before) & here
    total = tl.sum(taken.to(tl.int64), axis=0)
    ahead = tl.cumsum(taken.to(tl.int64), axis=0) - taken.to(tl.int64)  # taken tokens before t
    dest = tl.where(taken, ahead, total + (t - ahead))  # taken first, then the rest, in time order
    keep = here & (dest < K)
    tl.store(TAKEN + row * N + t, taken, mask=here)
    tl.store(IDX + row * K + dest, t.to(tl.int64), mask=keep)
    tl.store(POS_K + row * K + dest, pos, mask=keep)
    tl.store(FLAT + row * K + dest, row * N + t, mask=keep)
    j = tl.arange(0, BLOCK_K)
    tl.store(MEMBER + row * K + j, j < total, mask=j < K)
    tl.store(COUNT + row, total)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def _check(logit, tau, candidates, pos, k, count_out) -> None:
    """Shapes and dtypes the kernel relies on (ValueError: a caller's mistake, raised on every path)."""
    if logit.dim() != 2:
        raise ValueError(f"causal_select: logit must be [B, n], got {tuple(logit.shape)}")
    b, n = logit.shape
    if tau.dim() != 0:
        raise ValueError(f"causal_select: tau must be 0-d, got {tuple(tau.shape)}")
    if candidates is not None and (candidates.shape != (b, n) or candidates.dtype != torch.bool):
        raise ValueError(f"causal_select: candidates must be [{b}, {n}] bool, got {candidates.dtype} "
                         f"{tuple(candidates.shape)}")  # fmt: skip
    if pos is not None and (pos.shape != (b, n) or pos.dtype != torch.long):
        raise ValueError(f"causal_select: pos must be [{b}, {n}] int64, got {pos.dtype} {tuple(pos.shape)}")
    if not 1 <= k <= n:
        raise ValueError(f"causal_select: k={k} must be in [1, n={n}]")
    if count_out is not None and (count_out.shape != (b,) or count_out.dtype != torch.long):
        raise ValueError(f"causal_select: count_out must be [{b}] int64")


def causal_select_launch(
    logit: torch.Tensor,
    tau: torch.Tensor,
    candidates: torch.Tensor | None,
    pos: torch.Tensor | None,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    k: int,
    count_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the kernel (arguments and results as :func:`causal_select`). Rows of logit,
    candidates and pos may be strided; each must have unit stride along n."""
    b, n = logit.shape
    for name, t in (("logit", logit), ("candidates", candidates), ("pos", pos)):
        if t is not None and n > 1 and t.stride(1) != 1:
            raise ValueError(f"causal_select: {name} must have unit stride along n")
    dev = logit.device
    taken = torch.empty(b, n, dtype=torch.bool, device=dev)
    idx = torch.empty(b, k, dtype=torch.long, device=dev)
    member = torch.empty(b, k, dtype=torch.bool, device=dev)
    pos_k = torch.empty(b, k, dtype=torch.long, device=dev)
    flat = torch.empty(b * k, dtype=torch.long, device=dev)
    # the kernel stores count[b] at offset b: a strided count_out (a column of a wider buffer) gets
    # a contiguous stand-in, copied into it after the launch, instead of its neighbours overwritten
    strided_out = count_out is not None and not count_out.is_contiguous()
    count = torch.empty(b, dtype=torch.long, device=dev) if count_out is None or strided_out else count_out
    row_stride = [0 if t is None else t.stride(0) for t in (candidates, pos)]
    strides = (logit.stride(0), *row_stride)
    key = (b, n, k, strides, cap_q, capacity_bits, capacity_one, logit.dtype, tau.dtype,
           candidates is None, pos is None, logit.get_device())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        block = next_power_of_2(n)
        consts = {"N": n, "K": k, "BLOCK": block, "BLOCK_K": next_power_of_2(k),
                  "HAS_CAND": candidates is not None, "HAS_POS": pos is not None,
                  "CAP_BITS": capacity_bits, "CAP_ONE": capacity_one}  # fmt: skip
        warps = 4 if block <= 2048 else 8
        plan = _PLANS[key] = LaunchPlan(_causal_select_kernel, (b,), consts, warps, 1, logit.get_device())
    cand = logit if candidates is None else candidates  # an unused pointer when absent
    positions = logit if pos is None else pos
    with device_guard(logit):
        plan(logit, tau, cand, positions, taken, idx, member, pos_k, flat, count, *strides, int(cap_q))
    if strided_out:
        count = count_out.copy_(count)
    return taken, idx, member, pos_k, flat, count


# --- public function -----------------------------------------------------------------------------


def causal_select(
    logit: torch.Tensor,
    tau: torch.Tensor,
    candidates: torch.Tensor | None,
    pos: torch.Tensor | None,
    cap_q: int,
    capacity_bits: int,
    capacity_one: int,
    k: int,
    count_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """One routing point's causal selection for router logits [B, n] (compared with ``tau`` []
    as PyTorch compares them), ``candidates`` [B, n] bool (None: all), ``pos`` [B, n] int64
    (None: 0..n−1), the point's fixed-point capacity ``cap_q`` out of ``capacity_one`` =
    2**``capacity_bits``, and the gather size ``k`` (1 ≤ k ≤ n). Returns (taken [B, n] bool,
    idx [B, k], member [B, k] bool, pos_k [B, k], flat [B·k], count [B]) as the module docstring
    defines them; ``count_out`` [B] int64, when given, receives count in place (a decoding
    cache's counter). The Triton kernel runs for fp32 logits where hydra_kernels' Triton path is
    on for their device and n ≤ MAX_ROW; else :func:`causal_select_ref`.
    """
    _check(logit, tau, candidates, pos, k, count_out)
    check_devices(
        "causal_select", "logit tau candidates pos count_out", logit, tau, candidates, pos, count_out
    )
    args = (logit, tau, candidates, pos, cap_q, capacity_bits, capacity_one, k)

    def reference() -> tuple[torch.Tensor, ...]:
        out = causal_select_ref(*args)
        if count_out is None:
            return out
        count_out.copy_(out[-1])
        return (*out[:-1], count_out)

    # the kernel compares in fp32: exactly PyTorch's comparison for fp32 logits and a tau of at
    # most fp32 precision; other logits (fp64, half precision) compare in their own dtype there
    exact = logit.dtype == torch.float32 and tau.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not exact or logit.shape[1] > MAX_ROW or not controls.triton_path("causal_select", logit):
        return reference()
    return run_with_fallback("causal_select", lambda: causal_select_launch(*args, count_out), reference)
