"""Under torchrun every rank pretests, and only rank 0's verdicts decide. The second phase (the
compile arm on top of the switches that passed) steps with collectives, so every rank must build
it from the same verdicts: here rank 0's timings fail fa3 and rank 1's would pass it."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HYDRA_COMPILE_BACKEND="aot_eager")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        from hydra_train.distributed import DistInfo
        from hydra_train.safe_opts.registry import build_registry

        from .test_safe_opts_pretest import CompileStandIn, SwitchStandIn, make_trainer, runner

        tr, batches = make_trainer(Path(tmp) / f"rank{rank}")
        tr.dist = DistInfo(rank, 2, 0, "gloo")
        reg = build_registry(tr.cfg)
        for name in ("triton_kernels", "fa3"):
            reg[name] = SwitchStandIn(tr.cfg, name)
        reg["compile"] = CompileStandIn(tr.cfg, reg)
        r = runner(tr, batches, reg)
        judge = r._verdict

        def verdict(arm, *args):  # a speed verdict this rank's own timings tipped
            res = judge(arm, *args)
            if rank == 0 and arm.key == "fa3":
                res = {**res, "status": "FAIL", "reason": "slower (this rank's timings)"}
            return res

        r._verdict = verdict
        res = r.run(["compile", "triton_kernels", "fa3"])["results"]
        out = {"compile": res["compile"], "seen": reg["compile"].seen}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out, default=str))
    finally:
        dist.destroy_process_group()


def test_every_rank_stacks_compile_on_rank_0s_verdicts(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for out in ranks:
        assert out["seen"] == [["triton_kernels"]]  # fa3 failed on rank 0: on no rank's arm
        assert out["compile"]["ref"] == "triton_kernels" and out["compile"]["status"] == "PASS"
