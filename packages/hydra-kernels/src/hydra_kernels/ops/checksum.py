"""A tensor's checksum: its raw bits as unsigned words, each weighted by its position, summed modulo
2**64, in one kernel.

Why: hydra-model keeps a decoder's CUDA graphs between generations only while the weights they
read are unchanged (hydra_model/decoder_hold.py). Weights can change without a version bump (a
replayed training graph, an update through ``.data``), so their content is compared. A plain sum
misses permutations (a flipped conv weight); here word i counts ``2i + 1`` times:

    checksum(t) = Σ_i w_i · (2i + 1)   mod 2**64      (w_i: t's i-th word, zero-extended)

One changed word changes it (an odd multiplier is invertible modulo 2**64); swapping two unequal
words changes it by 2·(w_j − w_i)·(i − j), zero only for distances that are multiples of 2**62.

Faces: the PyTorch reference :func:`checksum_ref`, the Triton kernel ``_checksum_kernel`` with its
launcher :func:`checksum_launch` (which adds into an int64 slot, so that many tensors' checksums
land in one buffer with no reduction launch of their own), and :func:`checksums`, which runs the
kernel where hydra_kernels' Triton path is on for the tensors' device (CUDA, or the CPU under
``TRITON_INTERPRET=1``) and the reference elsewhere. Nothing is read on the host, so a call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import cdiv, device_guard, run_with_fallback
from hydra_kernels.ops._launch import LaunchPlan, plan_cache

#: Words one program reads.
BLOCK = 4096
#: Words the reference takes at a time.
REF_CHUNK = 1 << 20
#: signed integer views of each element size, to read raw bits
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits, flat: 32-bit words where its bytes divide into them (fewer, wider loads),
    else integers of its element size. Contiguous tensors only."""
    flat = t.detach().reshape(-1)
    if t.element_size() < 4 and (flat.numel() * t.element_size()) % 4 == 0:
        try:
            return flat.view(torch.int32)
        except RuntimeError:  # a storage offset that is not a whole word
            pass
    return flat.view(_WORDS[t.element_size()])


# --- PyTorch reference ---------------------------------------------------------------------------


def checksum_ref(w: torch.Tensor) -> torch.Tensor:
    """The checksum of words w (flat, any integer dtype) as a 0-d int64 (see the module docstring);
    in chunks of REF_CHUNK words, so that its int64 temporaries stay small."""
    bits = w.element_size() * 8
    total = torch.zeros((), dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), REF_CHUNK):
        part = w[start : start + REF_CHUNK].to(torch.int64)
        unsigned = part & ((1 << bits) - 1) if bits < 64 else part
        odd = torch.arange(start, start + part.numel(), device=w.device, dtype=torch.int64) * 2 + 1
        total += (unsigned * odd).sum()
    return total


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _checksum_kernel(W, OUT, n, BLOCK: tl.constexpr, BITS: tl.constexpr):
    # int64 products and sums wrap modulo 2**64: the checksum's own arithmetic
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(W + offs, mask=offs < n, other=0).to(tl.int64)
    if BITS < 64:
        w = w & ((1 << BITS) - 1)  # zero-extend: the word's bits, not its sign
    tl.atomic_add(OUT, tl.sum(w * (2 * offs + 1), axis=0))


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def checksum_launch(w: torch.Tensor, out: torch.Tensor) -> None:
    """Add the checksum of the flat contiguous words ``w`` into ``out`` (a 0-d int64 view)."""
    n = w.numel()
    if n == 0:
        return
    key = (n, w.dtype, w.get_device())
    plan = _PLANS.get(key)
    if plan is None:
        consts = {"BLOCK": BLOCK, "BITS": w.element_size() * 8}
        plan = _PLANS[key] = LaunchPlan(_checksum_kernel, (cdiv(n, BLOCK),), consts, 4, 1, w.get_device())
    with device_guard(w):
        plan(w, out, n)


# --- public function -----------------------------------------------------------------------------


def checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[len(tensors)] int64: each tensor's checksum (its raw bits, see the module docstring). All
    tensors on one device, contiguous; one kernel each where the Triton path is on."""
    if not tensors:
        raise ValueError("checksums: no tensors")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("checksums: the tensors must share one device")
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError("checksums: the tensors must be contiguous")
    flat = [words(t) for t in tensors]
    if not controls.triton_path("checksum", *flat):
        return torch.stack([checksum_ref(w) for w in flat])

    def launch() -> torch.Tensor:
        out = torch.zeros(len(flat), dtype=torch.int64, device=device)
        for i, w in enumerate(flat):
            checksum_launch(w, out[i])
        return out

    return run_with_fallback("checksum", launch, lambda: torch.stack([checksum_ref(w) for w in flat]))
