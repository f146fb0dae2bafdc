"""Background batch loading (``--experimental_prefetch_threads N``, ``--prefetch_buffer_size M``).

Batches are a pure function of their index (:class:`hydra_train.dataset.BatchPlan`), so threads
can build them in any order while the trainer receives them strictly in order: a queue of at
most ``M`` futures, one per upcoming index. With ``N = 0`` batches are built inline. On CUDA the
worker pins each batch, and the copy to the device is non-blocking. A worker's exception (bad
data) is raised in the trainer's thread when it asks for that batch, unchanged.

``position`` is the index of the next batch the *trainer* will receive: what a checkpoint stores,
whatever the workers have built ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class Prefetcher:
    def __init__(
        self,
        make_batch: Callable[[int], Batch],
        start: int = 0,
        *,
        threads: int = 0,
        buffer_size: int = 8,
        device: torch.device | str = "cpu",
    ):
        self.make_batch = make_batch
        self.position = int(start)
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.threads = int(threads)
        self.buffer_size = max(1, int(buffer_size))
        self._pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="hydra-prefetch") if self.threads else None
        )
        self._queue: deque[tuple[int, Future]] = deque()
        self._next_submit = self.position

    def _build(self, k: int) -> Batch:
        x, y = self.make_batch(k)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def _fill(self) -> None:
        while self._pool is not None and len(self._queue) < self.buffer_size:
            self._queue.append((self._next_submit, self._pool.submit(self._build, self._next_submit)))
            self._next_submit += 1

    def next(self) -> Batch:
        """The batch at ``position`` on the target device; advances ``position``."""
        if self._pool is None:
            x, y = self._build(self.position)
        else:
            self._fill()
            k, fut = self._queue.popleft()
            assert k == self.position
            x, y = fut.result()
            self._fill()
        self.position += 1
        if self.device.type != "cpu":
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
        return x, y

    def seek(self, position: int) -> None:
        """Continue from batch ``position`` (dropping anything built ahead)."""
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        self.position = self._next_submit = int(position)

    def close(self) -> None:
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
