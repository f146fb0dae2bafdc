"""Launch plans of the kernels that take many tensors at once (``total_norm``, ``adamw``).

Such a kernel gets up to ``group`` tensors a launch as tuples of pointers and runs a program per
``block`` elements of one of them. Each program finds its tensor from a small table on the device,
[2, group] int64 per launch: the first program of each tensor (ascending), then its size. Padding
entries start at :data:`NEVER`, past every grid, so no program picks them.

The kernels walk the table inline, each picking all its pointer tuples on one comparison per
entry (a shared helper picking one tuple at a time ran 2–4% slower on an H100). The tables depend
on the tensors' sizes only, so a plan is built once per list of sizes and the
tensors' addresses are passed at each launch (a captured CUDA graph replays with the addresses
it was captured with, as every captured kernel does). Building one copies its table to the
device, which a CUDA graph capture does not allow: :func:`cached_plan` refuses it there.

Each group's launch is a ``_launch.LaunchPlan``: after the first call through Triton's JIT the
compiled kernel is called directly. Binding an AdamW launch's 160-odd pointer arguments through
the JIT took 0.14-0.23 ms of host time a launch on an H100 (BENCHMARKS.md, 2026-11-27), which an
eager (not graphed) step pays at every launch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from hydra_kernels.ops._custom_op import cdiv
from hydra_kernels.ops._launch import LaunchPlan

#: A first program past every grid.
NEVER = 1 << 62


class TensorGroups:
    """Tensors of ``sizes`` in launch groups of at most ``group``, consecutive in the order of
    ``keys`` (a stable sort; a group holds one key: one dtype a launch, say). ``groups``: (member
    indices, the launch's first program counted over all launches, its programs); ``tables``:
    [launches, 2·group] int64 on ``device``; ``programs``: all launches' programs together."""

    def __init__(
        self, sizes: Sequence[int], keys: Sequence[Hashable], group: int, block: int, device: torch.device
    ):
        order = sorted(range(len(sizes)), key=lambda i: str(keys[i]))
        self.groups: list[tuple[list[int], int, int]] = []
        rows, start, i = [], 0, 0
        while i < len(order):
            members = [order[i]]
            while len(members) < group and i + len(members) < len(order):
                nxt = order[i + len(members)]
                if keys[nxt] != keys[members[0]]:
                    break
                members.append(nxt)
            firsts, total = [], 0
            for m in members:
                firsts.append(total)
                total += max(1, cdiv(sizes[m], block))  # an empty tensor's program does nothing
            pad = group - len(members)
            rows.append(firsts + [NEVER] * pad + [sizes[m] for m in members] + [0] * pad)
            self.groups.append((members, start, total))
            start += total
            i += len(members)
        self.programs = start
        self.tables = torch.tensor(rows, dtype=torch.int64).to(device)
        self._launches: dict[Hashable, LaunchPlan] = {}
        self.captured = False  # used inside a CUDA graph capture (cached_plan keeps it)

    def launch(self, g: int, fn, constexprs: dict, num_warps: int, key: Hashable = ()) -> LaunchPlan:
        """Group ``g``'s launch plan of the kernel ``fn`` (grid: its programs), built on first use;
        ``key``: whatever else the compiled kernel depends on (the constexprs, the dtypes of
        pointer arguments that are not the group's tensors)."""
        full = (g, fn, key, tuple(constexprs.items()), num_warps)
        plan = self._launches.get(full)
        if plan is None:
            grid, device = (self.groups[g][2],), max(self.tables.get_device(), 0)  # (−1 on the CPU)
            plan = self._launches[full] = LaunchPlan(fn, grid, constexprs, num_warps, 3, device)
        return plan


def plain_on_one_device(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> bool:
    """Whether ``tensors`` (at least one) are plain tensors or parameters (not DTensors or other
    subclasses, whose layout torch's own ops know), contiguous, of ``dtypes``, on one device:
    what the many-tensor kernels read through their pointer tuples."""
    if not tensors:
        return False
    device = tensors[0].device
    for t in tensors:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False
        if t.device != device or t.dtype not in dtypes or not t.is_contiguous():
            return False
    return True


def padded(tensors: Sequence[torch.Tensor], members: Sequence[int], group: int) -> tuple[torch.Tensor, ...]:
    """The launch's pointer tuple: its members, then its first member again up to ``group``."""
    picked = [tensors[i] for i in members]
    return tuple(picked + [picked[0]] * (group - len(picked)))


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph capture is under way on the current stream, for tensors on ``device``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def cached_plan(
    cache: dict, key: Hashable, make: Callable[[], TensorGroups], op: str, device: torch.device, limit: int
) -> TensorGroups:
    """``cache[key]``, built by ``make`` when missing. A plan built inside a CUDA graph capture is
    refused (a RuntimeError naming ``op``). When ``limit`` plans are held, the least recently used
    one that no capture used is dropped: a captured graph reads its plan's table at every replay,
    so that table must outlive the graph (a plan used inside a capture is kept for the process)."""
    is_capturing = capturing(device)
    # popped and put back last: the dict's order is from least to most recently used
    plan = cache.pop(key, None)
    if plan is None:
        if is_capturing:
            raise RuntimeError(
                f"{op}: a new set of tensor sizes inside a CUDA graph capture (its launch table is "
                "built by a host-to-device copy); call it once before capturing"
            )
        if len(cache) >= limit:
            # one plan at a time, not all: a step's plans that fit stay (dropping every plan made
            # an optimizer of more groups than the limit rebuild all of them at every step)
            stale = next((k for k, p in cache.items() if not p.captured), None)
            if stale is not None:
                del cache[stale]
        plan = make()
    elif is_capturing:
        plan.captured = True
    cache[key] = plan
    return plan
