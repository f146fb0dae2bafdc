"""Two-rank torchrun stand-ins on the CPU (gloo): spawn the ranks, collect each one's record."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp


def records_of_ranks(
    fn: Callable[..., None], args: tuple, out: Path, deadline_s: float, nprocs: int = 2
) -> list[dict[str, Any]]:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and return each rank's record (the
    JSON it wrote to ``out/rank{r}.json``) once all ended. A rank still running at the deadline (left
    in a collective, or hung at exit) is killed and fails the test; one that died of a signal
    (SIGABRT) raises torch's ProcessExitedException."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            done = sorted(p.name for p in out.glob("rank*.json"))
            pytest.fail(f"a rank was still running after {deadline_s} s; records written: {done}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]
