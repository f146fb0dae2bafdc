"""CUDA graphs: applicability and the optimizer's capturable mode on any machine; the capture
itself against the eager step where a GPU is present (skipped on the CPU CI)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hydra_train.config import TrainConfig
from hydra_train.distributed import DistInfo
from hydra_train.graphed_step import make_capturable, make_uncapturable
from hydra_train.optim import LRSchedule
from hydra_train.safe_opts.cuda_graphs import CudaGraphs


def fake_trainer(device, fused=True):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    return SimpleNamespace(device=torch.device(device), dist=DistInfo(), optimizer=opt)


def test_not_applicable_reasons():
    g = CudaGraphs(TrainConfig())
    assert g.not_applicable(fake_trainer("cpu")) == "needs CUDA"
    # the checks after the device need no GPU to be exercised
    assert "fused AdamW" in g.not_applicable(fake_trainer("cuda", fused=False))
    tr = fake_trainer("cuda")
    tr.dist = DistInfo(rank=0, world_size=2, local_rank=0, backend="nccl")
    assert g.not_applicable(tr) is None  # DDP steps are graphed, the averaging done by hand
    assert "FSDP2" in CudaGraphs(TrainConfig(fsdp=True)).not_applicable(tr)
    assert "reducer" in CudaGraphs(TrainConfig(ddp_grad_sync="reducer")).not_applicable(tr)
    assert "unused" in CudaGraphs(TrainConfig(ddp_find_unused_parameters=True)).not_applicable(tr)


def test_capturable_mode_and_the_schedule_writing_the_lr_in_place():
    tr = fake_trainer("cpu")
    sched = LRSchedule(tr.optimizer, kind="cosine", max_steps=10, warmup_steps=2)
    make_capturable(tr.optimizer, torch.device("cpu"))
    g = tr.optimizer.param_groups[0]
    lr_tensor = g["lr"]
    assert g["capturable"] and isinstance(lr_tensor, torch.Tensor)
    sched.step()
    assert g["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(sched.get_last_lr()[0])
    make_uncapturable(tr.optimizer)
    assert (
        not g["capturable"]
        and g["lr"] == pytest.approx(sched.get_last_lr()[0])
        and isinstance(g["lr"], float)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("warmup", [1, 2])
def test_replayed_steps_match_eager_steps(static, warmup, tmp_path, monkeypatch):
    """Two trainers from the same weights and batches: eager vs captured (dynamic or static routing),
    the capture's warm-up the optimizer's first step (warmup 1) or its second."""
    from hydra_kernels.ops import adamw
    from hydra_train.safe_opts.registry import build_registry
    from hydra_train.safe_opts.standalone import build_trainer

    cfg = TrainConfig(
        model_size="debug",
        batch_size=2,
        seq_len=128,
        device="cuda",
        dataset="random",
        static_routing_mode=static,
        checkpoint_dir=str(tmp_path),
        experimental_prefetch_threads=0,
    )
    losses = {}
    for graphed in (False, True):
        tr, _, cfg2 = build_trainer(cfg, log=lambda m: None)
        reg = build_registry(cfg2)
        if static:
            reg["static_routing"].activate(tr)
        else:
            reg["static_routing"].deactivate(tr)
        g = reg["cuda_graphs"]
        g.warmup = warmup
        if graphed:
            # no AdamW launch plan left by the eager run, as in a fresh process
            monkeypatch.setattr(adamw, "_PLANS", {})
            g.activate(tr)
        out = []
        for _ in range(6):
            res = tr.step_impl([tr.loader.next()])  # the trainer's step: eager, or its CUDA graph
            tr.schedule.step()
            out.append(float(res.loss))
        if graphed:
            # warmup W: steps before W eager; step W runs for real on the capture stream and is
            # captured right after; the later steps replay: one capture, no failure
            assert tr.graph_failures == []
            assert tr.cuda_graphs.captures == 1 and tr.cuda_graphs.replays == 6 - warmup
            g.deactivate(tr)
        losses[graphed] = out
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


def test_a_capture_reads_an_lr_tensor_on_its_own_device():
    """An lr tensor elsewhere (a checkpoint saved while graphed loads it on the CPU) is replaced
    by one on the capture device, keeping its value; one already there is kept (the schedule
    writes it in place)."""
    tr = fake_trainer("cpu")
    g = tr.optimizer.param_groups[0]
    g["lr"] = torch.tensor(3e-4)
    make_capturable(tr.optimizer, torch.device("meta"))
    assert g["lr"].device.type == "meta"
    g["lr"] = here = torch.tensor(2e-4)
    make_capturable(tr.optimizer, torch.device("cpu"))
    assert g["lr"] is here


def test_resume_leaves_no_graph_state_in_the_optimizer():
    """A checkpoint saved during a graphed run holds a tensor lr and capturable mode; resuming
    from it gives back a float lr and capturable off (a new capture sets both again)."""
    from hydra_train.trainer_state import TrainerStateMixin

    tr = fake_trainer("cpu")
    g = tr.optimizer.param_groups[0]
    saved = {"lr": torch.tensor(5e-4), "capturable": True}
    g.update(saved)
    TrainerStateMixin.reset_graph_state(tr.optimizer)
    assert isinstance(g["lr"], float) and g["lr"] == pytest.approx(5e-4) and g["capturable"] is False
