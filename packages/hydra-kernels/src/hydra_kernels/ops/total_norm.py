"""The L2 norm of many tensors taken together (a gradient clip's total norm), in a few launches.

Why: a training step that clips its gradients reads every gradient once for their total norm
before the optimizer reads them again. torch's ``get_total_norm`` (``_foreach_norm``, then a norm
of the per-tensor norms) took 0.38 ms for the 144 gradients of the 100M HYDRA preset on an H100,
where reading their 0.4 GB takes about 0.14 ms (packages/hydra-kernels/BENCHMARKS.md,
2026-11-27). Here one kernel takes up to ``GROUP`` tensors a launch, a program per ``BLOCK``
elements of one of them, and writes that block's sum of squares; one sum and a square root
finish it.

    total_norm(ts) = sqrt(Σ_t Σ_i t_i²)      (squares summed in fp32 for any input dtype)

Faces: the reference :func:`total_norm_ref` (torch's ``get_total_norm``: what a step without
the kernel computes), the Triton kernel ``_sq_sums_kernel`` with its launch plan, and
:func:`total_norm`, which runs the kernel where hydra_kernels' Triton path is on for the
tensors' device and they are plain contiguous fp32/bf16/fp16 tensors, and the reference
otherwise (DTensors, other dtypes or layouts). A kernel failure is counted as a fallback and
answered by the reference.

The programs find their tensor from a table of first programs and sizes on the device, built
once per list of sizes (``_tensor_groups.py``; a new one inside a CUDA graph capture is refused,
here a counted fallback), and nothing is read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import device_guard, run_with_fallback
from hydra_kernels.ops._tensor_groups import TensorGroups, cached_plan, padded, plain_on_one_device

#: Tensors one launch takes (the kernel's pointer tuple; a short last group is padded).
GROUP = 32
#: Elements one program reads (fp32: 32 KB), and its warps.
BLOCK = 8192
NUM_WARPS = 8
#: Input dtypes the kernel takes.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- PyTorch reference ---------------------------------------------------------------------------


def total_norm_ref(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch's ``get_total_norm(tensors, 2.0)``: each tensor's norm in its dtype, then their norm;
    returned in fp32 for bf16/fp16 inputs, as the kernel's is (fp64 stays fp64)."""
    norm = torch.nn.utils.get_total_norm(list(tensors), 2.0)
    # one dtype whichever path ran: callers take the norm as fp32 (the clip's divisor, the logged
    # norm), and a step's outputs should not change dtype with hydra_kernels' switches
    return norm.to(torch.promote_types(norm.dtype, torch.float32))


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _sq_sums_kernel(PTRS, TABLE, OUT, out_start, G: tl.constexpr, BLOCK: tl.constexpr):
    # TABLE [2, G] int64: the first program of each tensor (ascending), then its size; OUT is the
    # whole sums buffer, this launch's programs write from out_start (a view there could start
    # off a 16-byte boundary, which would keep the launch on Triton's JIT every call)
    pid = tl.program_id(0)
    ptr = PTRS[0]
    first = tl.load(TABLE)
    size = tl.load(TABLE + G)
    for j in tl.static_range(1, G):
        first_j = tl.load(TABLE + j)
        mine = pid >= first_j
        ptr = tl.where(mine, PTRS[j], ptr)
        size = tl.where(mine, tl.load(TABLE + G + j), size)
        first = tl.where(mine, first_j, first)
    offs = (pid - first).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < size, other=0.0).to(tl.float32)
    tl.store(OUT + out_start + pid, tl.sum(x * x, axis=0))


# --- host launch plan ----------------------------------------------------------------------------

_PLANS: dict[tuple, TensorGroups] = {}
#: Plans kept at most (a training run needs one; callers with ever-new lists do not grow it).
MAX_PLANS = 64


def _plan(tensors: Sequence[torch.Tensor]) -> TensorGroups:
    """Launch groups of one dtype each (``_tensor_groups.TensorGroups``), cached per list of sizes."""
    device, sizes, dtypes = tensors[0].device, [t.numel() for t in tensors], [t.dtype for t in tensors]
    key = (device, tuple(sizes), tuple(dtypes))
    make = lambda: TensorGroups(sizes, dtypes, GROUP, BLOCK, device)
    return cached_plan(_PLANS, key, make, "total_norm", device, MAX_PLANS)


def _run(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    plan = _plan(tensors)
    out = torch.empty(plan.programs, dtype=torch.float32, device=tensors[0].device)
    consts = {"G": GROUP, "BLOCK": BLOCK}
    for g, (members, first, _) in enumerate(plan.groups):
        launch = plan.launch(g, _sq_sums_kernel, consts, NUM_WARPS)
        launch(padded(tensors, members, GROUP), plan.tables[g], out, first)
    return out.sum().sqrt()


# --- public function -----------------------------------------------------------------------------


def kernel_takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`total_norm` runs the kernel on ``tensors`` (else the reference)."""
    return plain_on_one_device(tensors, KERNEL_DTYPES) and controls.triton_path("total_norm", *tensors)


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all elements of ``tensors`` together, 0-d, fp32 (fp64 for fp64 inputs): the
    kernel's (see the module docstring), or :func:`total_norm_ref`'s (torch's ``get_total_norm``)
    where the kernel does not take the tensors. An empty list gives 0."""
    tensors = list(tensors)
    if not kernel_takes(tensors):
        return total_norm_ref(tensors)

    def launch() -> torch.Tensor:
        with device_guard(tensors[0]):
            return _run(tensors)

    return run_with_fallback("total_norm", launch, lambda: total_norm_ref(tensors))
