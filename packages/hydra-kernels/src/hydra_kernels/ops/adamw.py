"""AdamW's update over many fp32 tensors, 32 a launch, reading and writing only what it must.

Why: torch's fused AdamW took 1.27 ms of the 100M HYDRA preset's graphed step on an H100, where
its bytes (parameter, gradient, both moments read; parameter and moments written: 28 a
parameter) take about 0.97 ms at the copy's bandwidth; a plain Triton AdamW over flat buffers
ran at 0.955 ms (packages/hydra-kernels/BENCHMARKS.md, 2026-11-27). Part of the difference is
torch's kernel writing each gradient back, divided by its ``grad_scale`` (4 bytes a parameter
that no one reads when the step clips the gradients through that scale, as hydra-train's does).

The update is torch's AdamW (``torch.optim.AdamW``, decoupled weight decay), per element, with
``t`` the tensor's step count after this step's increment:

    g = grad / grad_scale                          (when a grad_scale is given)
    p = p − lr·wd·p
    m = β1·m + (1 − β1)·g
    v = β2·v + (1 − β2)·g²
    p = p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)

and nothing is written where ``found_inf`` is 1 (the step counts are incremented first and
decremented by ``found_inf`` after, as torch does). β^t is computed as exp2(t·log2 β) in fp32,
with log2 0 = −inf for β = 0 (torch allows 0 ≤ β < 1): β^t = 0 for t ≥ 1, as torch's.
The gradients are left as they were.

Faces: the reference :func:`adamw_step_ref_` (the same arithmetic with torch ops, per tensor), the
Triton kernel ``_adamw_kernel`` (a program per ``BLOCK`` elements of one tensor, found from a
table of first programs and sizes, ``_tensor_groups.py``; a tuple of pointers per operand), and
:func:`adamw_step_`, which runs the kernel where :func:`kernel_takes` and the reference
otherwise. It reads nothing on the host, so a step can be captured in a CUDA
graph (``lr`` and the step counts as device tensors); a new set of sizes inside a capture is an
error, as its table is built by a host-to-device copy (:func:`launchable` tells beforehand).

Devices: every tensor of a call is on the parameters' device, or the call is a ValueError naming
the one that is not (:func:`_checked_lr`), with one exception taken from torch's fused AdamW
(torch/optim/adam.py, ``_fused_adam``: "we prefer treating it as a scalar"): ``lr`` as a CPU
tensor beside parameters elsewhere is read on the host as a number (not inside a CUDA graph
capture, where that number would be fixed into the graph).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops import _tensor_groups
from hydra_kernels.ops._custom_op import check_devices, device_guard
from hydra_kernels.ops._tensor_groups import TensorGroups, cached_plan, padded, plain_on_one_device

#: Tensors one launch takes (five pointer tuples of this length; a short last group is padded).
GROUP = 32
#: Elements one program updates, and its warps (1024/4 and 2048/8 ran level on an H100 and an
#: H200; a program updating 2-8 blocks in turn did not run faster: BENCHMARKS.md, 2026-11-27).
BLOCK = 2048
NUM_WARPS = 8
#: Plans kept at most, the least recently used dropped first. One a list of sizes: one an
#: optimizer param group, as hydra-train launches per group, so far above any model's groups; a
#: plan's table is 512 bytes on the device a launch (of up to GROUP tensors).
MAX_PLANS = 1024


def log2_beta(beta: float) -> float:
    """log2 β for β^t = exp2(t·log2 β): −inf for β = 0, whose exp2(t·−inf) is 0 for t ≥ 1."""
    return math.log2(beta) if beta else -math.inf


# --- PyTorch reference ---------------------------------------------------------------------------


def adamw_step_ref_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The module docstring's update with torch ops, in place, in the tensors' dtype."""
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        t += 1
        g_used = g if grad_scale is None else g / grad_scale
        bc1 = 1 - torch.exp2(t * log2_beta(beta1))
        bc2 = 1 - torch.exp2(t * log2_beta(beta2))
        new_p = p - lr * weight_decay * p
        new_m = beta1 * m + (1 - beta1) * g_used
        new_v = beta2 * v + (1 - beta2) * g_used * g_used
        new_p = new_p - (lr / bc1) * new_m / (new_v.sqrt() / bc2.sqrt() + eps)
        if found_inf is None:
            p.copy_(new_p)
            m.copy_(new_m)
            v.copy_(new_v)
        else:
            keep = found_inf == 1
            p.copy_(torch.where(keep, p, new_p))
            m.copy_(torch.where(keep, m, new_m))
            v.copy_(torch.where(keep, v, new_v))
            t -= found_inf


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _adamw_kernel(
    P, G, M, V, S, TABLE, LR, SCALE, INF,
    lr_value, log2_beta1, log2_beta2, beta1, beta2, eps, weight_decay,
    LR_ON_DEVICE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, NG: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # TABLE [2, NG] int64 (_tensor_groups.py): each tensor's first program (ascending), then its
    # size; the five pointers are picked on one comparison an entry
    pid = tl.program_id(0)
    p_ptr, g_ptr, m_ptr, v_ptr, s_ptr = P[0], G[0], M[0], V[0], S[0]
    first = tl.load(TABLE)
    size = tl.load(TABLE + NG)
    for j in tl.static_range(1, NG):
        first_j = tl.load(TABLE + j)
        mine = pid >= first_j
        p_ptr = tl.where(mine, P[j], p_ptr)
        g_ptr = tl.where(mine, G[j], g_ptr)
        m_ptr = tl.where(mine, M[j], m_ptr)
        v_ptr = tl.where(mine, V[j], v_ptr)
        s_ptr = tl.where(mine, S[j], s_ptr)
        size = tl.where(mine, tl.load(TABLE + NG + j), size)
        first = tl.where(mine, first_j, first)
    if HAS_INF:  # a skipped step reads and writes nothing
        size = tl.where(tl.load(INF) == 1.0, 0, size)
    offs = (pid - first).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    t = tl.load(s_ptr).to(tl.float32)
    if LR_ON_DEVICE:  # noqa: SIM108 (a compile-time branch)
        lr = tl.load(LR).to(tl.float32)
    else:
        lr = lr_value
    bc1 = 1.0 - tl.exp2(t * log2_beta1)
    bc2 = 1.0 - tl.exp2(t * log2_beta2)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(SCALE).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / tl.sqrt(bc2) + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


# --- host launch plan ----------------------------------------------------------------------------

_PLANS: dict[tuple, TensorGroups] = {}


def _key(params: Sequence[torch.Tensor]) -> tuple:
    return params[0].device, tuple(p.numel() for p in params)


def _plan(params: Sequence[torch.Tensor]) -> TensorGroups:
    """Launch groups of consecutive tensors (``_tensor_groups.TensorGroups``), cached per list of sizes."""
    key = _key(params)
    device, sizes = key
    make = lambda: TensorGroups(sizes, [0] * len(sizes), GROUP, BLOCK, device)
    return cached_plan(_PLANS, key, make, "adamw_step_", device, MAX_PLANS)


# --- device checks -------------------------------------------------------------------------------

#: adamw_step_'s list arguments, for error messages
_LIST_NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")


def _checked_lr(
    p0: torch.Tensor,
    lr: float | torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> float | torch.Tensor:
    """``lr`` as the step reads it, after refusing a scalar tensor on another device than the first
    parameter ``p0`` (a ValueError naming it). Why: a launch reads every pointer on ``p0``'s
    device, so one elsewhere failed the first launch (a counted fallback, then torch's unnamed
    device error in the reference) or, once the launch plan calls the compiled kernel directly,
    would be read through a pointer of another device. A CPU ``lr`` beside parameters elsewhere is
    a number, as torch's fused AdamW takes it (no sync: its value is in host memory); inside a
    capture it is refused, as the graph would replay the value it had then, whatever the
    schedule sets later."""
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and p0.device.type != "cpu":
        if _tensor_groups.capturing(p0.device):
            raise ValueError(
                f"adamw_step_: lr is a CPU tensor inside a CUDA graph capture: its value would be fixed "
                f"into the graph; pass lr as a tensor on {p0.device}"
            )
        lr = float(lr)
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    check_devices("adamw_step_", "params[0] lr grad_scale found_inf", p0, lr_tensor, grad_scale, found_inf)
    return lr


def _check_list_devices(lists: Sequence[Sequence[torch.Tensor]]) -> None:
    """A ValueError naming the first tensor of the lists off the first parameter's device (the
    reference's torch ops would fail naming none, or step CPU step counts of GPU parameters on
    the host, tensor by tensor). Only where :func:`kernel_takes` said no: it checks one device."""
    device = lists[0][0].device
    for name, tensors in zip(_LIST_NAMES, lists, strict=True):
        for i, t in enumerate(tensors):
            if t.device != device:
                raise ValueError(
                    f"adamw_step_: {name}[{i}] {tuple(t.shape)} {t.dtype} is on {t.device} but params[0] is "
                    f"on {device}; pass every tensor of the call on one device"
                )


# --- public functions ----------------------------------------------------------------------------


def kernel_takes(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`adamw_step_` runs the kernel on these lists (parameters, gradients, moments,
    step counts): plain contiguous fp32 tensors on one device, and the Triton path on there."""
    every = [t for ts in lists for t in ts]
    return (
        bool(lists[0])
        and plain_on_one_device(every, (torch.float32,))
        and controls.triton_path("adamw", *lists[0])  # one device for all: the parameters' decides
    )


def launchable(params: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`adamw_kernel_step_` can launch on ``params`` now: their launch plan is
    cached, or no CUDA graph capture is under way (inside one, building a plan is refused)."""
    return not _tensor_groups.capturing(params[0].device) or _key(params) in _PLANS


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place (the module docstring); ``steps``: each tensor's 0-d step count,
    incremented here. The kernel where :func:`kernel_takes` (:func:`adamw_kernel_step_`), else
    :func:`adamw_step_ref_`. Every tensor on the parameters' device (a CPU ``lr`` aside: the
    module docstring), else a ValueError naming it."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_step_: lists of different lengths {[len(x) for x in lists]}")
    kw = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    if kernel_takes(*lists):  # the scalars are checked there
        adamw_kernel_step_(*lists, grad_scale=grad_scale, found_inf=found_inf, **kw)
        return
    if params:
        _check_list_devices(lists)
        kw["lr"] = _checked_lr(params[0], lr, grad_scale, found_inf)
    adamw_step_ref_(*lists, grad_scale=grad_scale, found_inf=found_inf, **kw)


def adamw_kernel_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    **kw: float | torch.Tensor,
) -> None:
    """:func:`adamw_step_`'s kernel path (``kw``: its lr, beta1, beta2, eps, weight_decay), for a
    caller that has asked :func:`kernel_takes` already (hydra-train's step asks once per
    optimizer group). A failure of the first launch is counted as a fallback and answered by the
    reference; of a later one, raised (the launches before it have updated their tensors). Its
    scalar tensors are checked as :func:`adamw_step_`'s (the lists were, by kernel_takes)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    kw = {**kw, "lr": _checked_lr(params[0], kw["lr"], grad_scale, found_inf)}
    lr, beta1, beta2 = kw["lr"], float(kw["beta1"]), float(kw["beta2"])
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if not p.shape == g.shape == m.shape == v.shape:
            raise ValueError(
                f"adamw_step_: a parameter of shape {tuple(p.shape)} with a gradient or state of another"
            )
    plan = _plan(params)
    lr_on_device = isinstance(lr, torch.Tensor)
    dummy = params[0]
    lr_ptr = lr if lr_on_device else dummy
    scale_ptr = dummy if grad_scale is None else grad_scale
    inf_ptr = dummy if found_inf is None else found_inf
    consts = {
        "LR_ON_DEVICE": lr_on_device, "HAS_SCALE": grad_scale is not None, "HAS_INF": found_inf is not None,
        "NG": GROUP, "BLOCK": BLOCK,
    }  # fmt: skip
    dtypes = (lr_ptr.dtype, scale_ptr.dtype, inf_ptr.dtype)  # the compiled kernel is typed by them
    scalars = (
        0.0 if lr_on_device else float(lr), log2_beta(beta1), log2_beta(beta2), beta1, beta2,
        float(kw["eps"]), float(kw["weight_decay"]),
    )  # fmt: skip
    with device_guard(params[0]):
        torch._foreach_add_(list(steps), 1)
        for g_idx, (members, _, _) in enumerate(plan.groups):
            try:
                launch = plan.launch(g_idx, _adamw_kernel, consts, NUM_WARPS, dtypes)
                launch(
                    *(padded(x, members, GROUP) for x in lists), plan.tables[g_idx],
                    lr_ptr, scale_ptr, inf_ptr, *scalars,
                )  # fmt: skip
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if g_idx:  # earlier launches have stepped their tensors: no clean way back
                    raise RuntimeError(f"adamw_step_: launch {g_idx} failed after {g_idx} succeeded") from exc
                # nothing updated yet: undo the count, count the fallback, step by the reference
                torch._foreach_sub_(list(steps), 1)
                controls.record_fallback("adamw", exc)
                adamw_step_ref_(*lists, grad_scale=grad_scale, found_inf=found_inf, **kw)
                return
        if found_inf is not None:
            torch._foreach_sub_(list(steps), [found_inf] * len(steps))
