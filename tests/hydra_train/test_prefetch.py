"""Background batch loading: order, errors surfacing in the trainer's thread, seek, and no lag."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hydra_train.errors import HydraDataError
from hydra_train.prefetch import Prefetcher


def _make(k: int):
    # later batches finish first: ordering must come from the queue, not from completion
    time.sleep(0.002 * ((7 - k) % 5))
    x = torch.full((2, 3), k)
    return x, x + 1


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_batches_arrive_in_order(threads):
    with Prefetcher(_make, start=5, threads=threads, buffer_size=4) as p:
        got = [int(p.next()[0][0, 0]) for _ in range(12)]
        assert got == list(range(5, 17)) and p.position == 17


def test_worker_error_is_raised_unchanged_at_that_batch():
    def make(k):
        if k == 3:
            raise HydraDataError("shard.bin: token id 9 is outside the vocabulary")
        return torch.zeros(1), torch.zeros(1)

    with Prefetcher(make, threads=2, buffer_size=4) as p:
        p.next(), p.next(), p.next()
        with pytest.raises(HydraDataError, match=r"shard\.bin"):
            p.next()


def test_seek_restarts_from_a_position_and_workers_run_ahead():
    built = []
    lock = threading.Lock()

    def make(k):
        with lock:
            built.append(k)
        return torch.tensor([k]), torch.tensor([k])

    with Prefetcher(make, threads=2, buffer_size=3) as p:
        assert int(p.next()[0]) == 0
        deadline = time.time() + 5
        while len(built) < 4 and time.time() < deadline:
            time.sleep(0.01)
        assert set(built) >= {1, 2, 3}  # built ahead while the trainer did nothing
        p.seek(40)
        assert [int(p.next()[0]) for _ in range(2)] == [40, 41] and p.position == 42
