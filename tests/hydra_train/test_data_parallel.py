"""The hand-rolled gradient averaging (hydra_train.data_parallel) on two gloo processes: every
bucketing path, a gradient one rank lacks, the buffers DDP would broadcast and the ones it leaves.
The end-to-end comparison with one process is test_distributed.py's ``allreduce`` case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hydra_train.data_parallel import GradAverager, _plan_buckets


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(64))  # 256 bytes: a bucket of its own, reduced in place
        self.a = nn.Parameter(torch.zeros(3, 2))
        self.b = nn.Parameter(torch.zeros(5))
        self.c = nn.Parameter(torch.zeros(4, dtype=torch.float64))  # another dtype, another bucket
        self.unused = nn.Parameter(torch.zeros(2))  # rank 1 leaves it without a gradient
        self.register_buffer("shared", torch.zeros(3))  # DDP broadcasts it from rank 0
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("per_rank", torch.zeros(2))  # asked to be left alone
        self._ddp_params_and_buffers_to_ignore = ["per_rank"]


def _grad(name: str, p: nn.Parameter, rank: int) -> torch.Tensor:
    base = torch.arange(1, p.numel() + 1, dtype=p.dtype).reshape(p.shape) * (1 + len(name))
    return base * (rank + 1)


def _worker(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = _Toy()
        params = dict(model.named_parameters())
        for name, p in params.items():
            if not (name == "unused" and rank == 1):
                p.grad = _grad(name, p, rank)
        with torch.no_grad():
            model.shared.fill_(10.0 + rank)
            model.count.fill_(7 + rank)
            model.per_rank.fill_(float(rank))
        avg = GradAverager(list(params.values()), model, 2, bucket_bytes=128)
        assert [len(b) for b in avg.buckets] == [1, 3, 1], avg.buckets  # big | a, b, unused | c
        avg.average_gradients()
        avg.broadcast_buffers()
        for name, p in params.items():
            # ranks 1 and 2 times the base: the mean is 1.5 times; the unused one (0 and 1 times) 0.5
            want = _grad(name, p, 0) * (0.5 if name == "unused" else 1.5)
            torch.testing.assert_close(p.grad, want, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(model.shared, torch.full((3,), 10.0)) and int(model.count) == 7
        assert torch.equal(model.per_rank, torch.full((2,), float(rank)))
    finally:
        dist.destroy_process_group()


def test_grad_averager_on_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_buckets_group_one_dtype_up_to_the_size():
    ps = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 40, 10)] + [nn.Parameter(torch.zeros(1).double())]
    # 40 B + 40 B fill a bucket; 160 B is reduced alone, in place; the float64 one has its own
    assert _plan_buckets(ps, bucket_bytes=80) == [[2], [0, 1], [3], [4]]


def test_one_process_is_refused():
    with pytest.raises(ValueError, match="2 or more"):
        GradAverager([], nn.Linear(2, 2), 1)
