"""The last ``rows`` real rows of each sequence of a prefix-masked batch, copied out flat, in one
kernel (no autograd).

Why: a prompt's prefill through a routed block (hydra_model's ccgqa.py) keeps, per sequence, the
convolution's state (the last K−1 real inputs) and the value shift's source (the last real
token's): with a different count of real tokens in each sequence, op by op that is a pad, an
arange, an add, two gathers and the copies, about nine launches a routed block at batch 1, where
a prefill is bound by its host launches. Here it is one launch per state.

For each sequence b with ``length[b]`` real rows at the front of src [B, n, C]:

    dst[b, s·C + c] = src[b, length[b] − rows + s, c]   (0 where that row index is negative)

for s in [0, rows), c in [0, C): the rows before the first are zeros, as a left-padded window.

Faces: the PyTorch reference :func:`last_rows_ref`, the Triton kernel ``_last_rows_kernel`` (a
tile of one sequence's output a program) with its launcher :func:`last_rows_launch`, and
:func:`last_rows`, which runs the kernel where hydra_kernels' Triton path is on for src's device
(CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere. Nothing is read on
the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import cdiv, device_guard, next_power_of_2, run_with_fallback
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Output elements a program copies at most.
MAX_BLOCK = 1024


# --- PyTorch reference ---------------------------------------------------------------------------


def last_rows_ref(src: torch.Tensor, length: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows·C] op by op: the rows left-padded with ``rows`` zeros, gathered at length + s."""
    b, _, c = src.shape
    padded = F.pad(src, (0, 0, rows, 0))  # [B, rows + n, C]: padded row length + s is row length − rows + s
    idx = length.long().view(b, 1) + torch.arange(rows, device=src.device).view(1, -1)  # [B, rows]
    return padded.gather(1, idx.unsqueeze(-1).expand(b, rows, c)).reshape(b, rows * c)


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _last_rows_kernel(
    SRC, DST, LEN, n, stride_sb, stride_st, stride_db,
    ROWS: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = q < ROWS * C
    s = q // C
    c = q % C
    t = tl.load(LEN + b).to(tl.int64) - ROWS + s
    real = inside & (t >= 0) & (t < n)
    val = tl.load(SRC + b * stride_sb + t * stride_st + c, mask=real, other=0.0)
    tl.store(DST + b * stride_db + q, val, mask=inside)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def last_rows_launch(src: torch.Tensor, length: torch.Tensor, rows: int, out: torch.Tensor) -> torch.Tensor:
    """Launch the kernel (arguments as :func:`last_rows`, already checked): src with unit stride
    along C, out [B, rows·C] with unit column stride, length contiguous."""
    b, n, c = src.shape
    width = rows * c
    if b == 0 or width == 0:
        return out
    key = (b, n, c, rows, src.stride(0), src.stride(1), out.stride(0), src.dtype, length.dtype)
    key += (src.get_device(),)
    plan = _PLANS.get(key)
    if plan is None:
        block = min(next_power_of_2(width), MAX_BLOCK)
        consts = {"ROWS": rows, "C": c, "BLOCK": block}
        grid = (b, cdiv(width, block))
        plan = _PLANS[key] = LaunchPlan(_last_rows_kernel, grid, consts, 4, 1, src.get_device())
    with device_guard(src):
        plan(src, out, length, n, src.stride(0), src.stride(1), out.stride(0))
    return out


# --- public function -----------------------------------------------------------------------------


def last_rows(
    src: torch.Tensor, length: torch.Tensor, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, rows·C]: the last ``rows`` of the first ``length[b]`` rows of src [B, n, C] (any
    strides), zeros before row 0 (see the module docstring); ``length`` [B] integers in [0, n].
    ``out``: a [B, rows·C] tensor of src's dtype to write (unit column stride), else a new one.
    The Triton kernel runs where hydra_kernels' Triton path is on for src's device; a
    switched-off path or another device run :func:`last_rows_ref`. No autograd."""
    if src.dim() != 3 or length.shape != (src.shape[0],) or length.is_floating_point() or rows < 0:
        raise ValueError(
            f"last_rows: src [B, n, C], length [B] integers, rows >= 0; got {tuple(src.shape)}, "
            f"{tuple(length.shape)} {length.dtype}, rows={rows}"
        )
    b, _, c = src.shape
    if out is not None and (out.shape != (b, rows * c) or out.dtype != src.dtype):
        raise ValueError(
            f"last_rows: out must be [{b}, {rows * c}] {src.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    kernel = controls.triton_path("last_rows", src, length) and (out is None or out.stride(1) == 1)
    if not kernel:
        ref = last_rows_ref(src, length, rows)
        return ref if out is None else out.copy_(ref)
    if c and src.stride(2) != 1:
        src = src.contiguous()
    length = length.contiguous()
    dst = torch.empty(b, rows * c, dtype=src.dtype, device=src.device) if out is None else out

    def reference() -> torch.Tensor:
        return dst.copy_(last_rows_ref(src, length, rows))

    return run_with_fallback("last_rows", lambda: last_rows_launch(src, length, rows, dst), reference)
