"""Peak device memory over a stretch of work (timed benchmark steps, a race's training), read one
way wherever hydra-diag reports it: ``bench model`` and the sweeps (harness.py), ``race run``
(race/loop.py) and ``bench/race_profile.py``.

Call :func:`reset_peak_memory` once the warm-up is over, run the work, then :func:`peak_memory`.
Its figures, in GiB (:data:`MEMORY_FIELDS`):

- ``peak_gib``: the most device memory torch's caching allocator held in between
  (``max_memory_reserved``), the cache emptied at the reset: every live tensor, the private pools
  of captured CUDA graphs, and the blocks the allocator kept cached or could not fill between the
  work's own allocations. That is what the device must have for the work to fit (less the CUDA
  context and anything allocated outside torch's allocator, which no figure here counts).
- ``graph_pool_gib``: the part of the memory held at the reading that is in private pools (CUDA
  graphs'); 0 without graphs; None when torch does not say which pool a segment is in.
- ``peak_allocated_gib``: ``max_memory_allocated`` over the same stretch: the tensors alive at
  the reset and those allocated after it. A CUDA graph allocates its activations and gradients in
  its pool once, at capture; a replay writes into the pool without allocating. So under graphs,
  with the warm-up's capture before the reset, this leaves out the step's activations and
  gradients: for the 100M entrants at 8 × 2048 it was parameters plus AdamW's moments (1.12
  and 1.19 GiB, packages/hydra-diag/BENCHMARKS.md's race_profile.py table of 2026-11-27). It is
  the figure that ``bench model`` and the sweeps (as ``peak_gib``), the race (as
  ``peak_memory_gib``) and race_profile.py (as ``peak_gib``) reported before this module;
  without graphs it is the tensors' peak, below ``peak_gib`` by what the allocator caches.

Off CUDA every figure is None and the reset does nothing.
"""

from __future__ import annotations

import gc

import torch

MEMORY_FIELDS = ("peak_gib", "graph_pool_gib", "peak_allocated_gib")
_GIB = 2**30
_DEFAULT_POOL = (0, 0)  # the id torch gives the caching allocator's ordinary pool


def reset_peak_memory(device: torch.device, release_cache: bool = True) -> None:
    """Start the stretch :func:`peak_memory` reads: free what only reference cycles hold, release
    the cached blocks (a warm-up's eager step and the compiler's autotuning leave gigabytes cached,
    which the reserved peak would count) and reset the peaks. The private pool of a live CUDA graph
    is not released (``empty_cache`` frees no block of it), so it stays in the reserved figure.
    What was released is allocated again by the next step: time that step outside any clock where
    a caller can (harness.py, race_profile.py). ``release_cache=False`` keeps the cached blocks
    (the race: its clock starts right after, and a first step that asks the driver for gigabytes
    again would be on it); ``peak_gib`` then also counts what the warm-up left cached."""
    if device.type != "cuda":
        return
    if release_cache:
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def _graph_pool_bytes(index: int) -> int | None:
    pool = 0
    for seg in torch.cuda.memory_snapshot():  # every device's segments
        if seg.get("device", index) != index:
            continue
        if "segment_pool_id" not in seg:  # a torch that does not say: unknown, not zero
            return None
        if tuple(seg["segment_pool_id"]) != _DEFAULT_POOL:
            pool += seg["total_size"]
    return pool


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """:data:`MEMORY_FIELDS` in GiB since :func:`reset_peak_memory` (the module's docstring says
    what each counts); all None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(MEMORY_FIELDS)
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _graph_pool_bytes(index)
    return {
        "peak_gib": torch.cuda.max_memory_reserved(device) / _GIB,
        "graph_pool_gib": None if pool is None else pool / _GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
    }
