"""A stand-in for torch.cuda's caching-allocator counters, for the memory readings of
hydra_diag.device_memory and its callers on the CPU."""

from __future__ import annotations

import pytest
import torch

MIB = 2**20


class FakeAllocator:
    """torch.cuda's counters as the caching allocator keeps them, for one device (0) and what these
    tests need: an allocation is counted as allocated, and as reserved when no cached free block
    takes it; a freed block stays reserved (cached) until empty_cache, which releases the default
    pool's free blocks but not a live graph's private pool; capturing a graph allocates in its
    pool (counted), and the blocks freed by the end of the capture stay in the pool; a replay
    allocates nothing."""

    def __init__(self) -> None:
        self.used = self.cached = self.pool = self.pool_used = 0
        self.peak_allocated = self.peak_reserved = 0
        self.calls: list[str] = []

    @property
    def allocated(self) -> int:
        return self.used + self.pool_used

    @property
    def reserved(self) -> int:
        return self.used + self.cached + self.pool

    def _peaks(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def alloc(self, n: int) -> None:
        self.cached -= min(n, self.cached)
        self.used += n
        self._peaks()

    def free(self, n: int) -> None:
        self.used -= n
        self.cached += n

    def capture(self, n: int) -> None:
        self.pool = max(self.pool, n)
        self.pool_used = n
        self._peaks()
        self.pool_used = 0

    def warm_up_race_style(self) -> None:
        """The race's warm-up: parameters and AdamW state (1140 MiB), an eager step (9000 MiB of
        activations, then cached), the capture (7000 MiB in the graph's pool)."""
        self.alloc(1140 * MIB)
        self.alloc(9000 * MIB)
        self.free(9000 * MIB)
        self.capture(7000 * MIB)

    def graphed_step(self) -> torch.Tensor:
        """A graph replay: only the eager parts (the batch, the optimizer's temporaries) allocate."""
        self.alloc(50 * MIB)
        self.free(50 * MIB)
        return torch.tensor(1.0)

    # the torch.cuda functions hydra-diag calls
    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def max_memory_allocated(self, device=None) -> int:
        return self.peak_allocated

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_reserved

    def synchronize(self, device=None) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def memory_snapshot(self) -> list[dict]:
        return [
            {"device": 0, "total_size": self.used + self.cached, "segment_pool_id": (0, 0)},
            {"device": 0, "total_size": self.pool, "segment_pool_id": (1, 0)},
            {"device": 1, "total_size": 999 * MIB, "segment_pool_id": (2, 0)},  # another GPU's
        ]


class FakeEvent:
    """torch.cuda.Event for timing: every step takes 2 ms."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.0


def install(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A FakeAllocator in place of torch.cuda's counters (and its Event) for one test."""
    fake = FakeAllocator()
    for name in (
        "empty_cache",
        "reset_peak_memory_stats",
        "max_memory_allocated",
        "max_memory_reserved",
        "synchronize",
        "current_device",
        "memory_snapshot",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return fake
