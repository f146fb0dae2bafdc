"""The graphed step's state machine on the CPU: the capture mechanism is replaced by a recorder
(what hydra_kernels.cuda_graph.CUDAGraphStep would run), so the sequence of eager steps, the
warm-up-and-capture step and replays, the loss-scale hand-off and the failure paths are checked
without a GPU (the real capture is tests/hydra_train/test_safe_opts_cuda_graphs.py, CUDA only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hydra_train.graphed_step as graphed_step
from hydra_train.distributed import DistInfo
from hydra_train.step import StepMixin, StepResult


class RecordingGraph:
    """Stands in for CUDAGraphStep: warm_up runs the body for real, capture records nothing,
    replay runs the body again (what a replay computes)."""

    def __init__(self, fn, *inputs, stream=None):
        self.fn, self.static_inputs = fn, list(inputs)
        self.captured = False
        self.fail_clone_after_replay = False

    def warm_up(self, calls=1):
        return self.fn(*self.static_inputs)

    def capture(self):
        self.captured = True

    def load(self, *inputs):
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            dst.copy_(src)

    def replay(self):
        out = self.fn(*self.static_inputs)
        if self.fail_clone_after_replay:
            out.clone = lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("copying the outputs"))
        return out

    def release(self):
        pass


class FakeTrainer(SimpleNamespace):
    """The attributes StepMixin.run_step and GraphedStep use; micro_step records each call's loss
    scale and counts applied optimizer steps."""

    def __init__(self):
        p = torch.nn.Parameter(torch.ones(2))
        super().__init__(
            device=torch.device("cpu"),
            dist=DistInfo(),  # one process: a capture needs no other rank's word
            optimizer=torch.optim.AdamW([p], lr=1e-3, fused=True),
            scales=[],
            applied=0,
            failures=[],
            cuda_graphs=None,
            step=0,
            logged=[],
        )
        self.log = self.logged.append

    def micro_step(self, batches, loss_scale=None, hooks=True):
        self.scales.append(None if loss_scale is None else float(loss_scale))
        self.applied += 1
        z = torch.zeros(())
        return StepResult(z, z, {}, z, torch.ones((), dtype=torch.bool))

    def eager_step(self, batches):
        return self.micro_step(batches)

    def _graph_failed(self, why):
        self.failures.append(why)


@pytest.fixture
def tr(monkeypatch):
    recorder = classmethod(lambda cls, *a, **k: RecordingGraph(*a, **k))
    monkeypatch.setattr(graphed_step.CUDAGraphStep, "deferred", recorder)
    monkeypatch.setattr(graphed_step, "capture_stream", lambda device: None)  # the recorder needs none
    trainer = FakeTrainer()
    trainer.cuda_graphs = graphed_step.GraphedStep(trainer, warmup=3)
    return trainer


def batch():
    return [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))]


def test_eager_steps_then_capture_then_replays(tr):
    for _ in range(5):
        StepMixin.run_step(tr, batch())
    # steps 1-2 eager (no scale), step 3 the warm-up call on the capture stream (scale 1), 4-5 replays
    assert tr.scales == [None, None, 1.0, 1.0, 1.0]
    assert tr.applied == 5 and tr.cuda_graphs.captures == 1 and tr.cuda_graphs.replays == 2
    assert tr.failures == []
    # the capture's cost is said once, by the call that captured
    assert len(tr.logged) == 1 and tr.logged[0].startswith("CUDA graph: the step captured at step 0 in ")


def test_a_loss_scale_set_during_an_eager_step_does_not_reach_the_capture(tr):
    tr.cuda_graphs.scale_next_loss(float("nan"))  # a fault injected at eager step 1
    StepMixin.run_step(tr, batch())
    StepMixin.run_step(tr, batch())
    StepMixin.run_step(tr, batch())  # the warm-up-and-capture step
    assert tr.scales == [None, None, 1.0]
    tr.cuda_graphs.scale_next_loss(float("inf"))  # a fault meant for a graphed step reaches it
    StepMixin.run_step(tr, batch())
    assert tr.scales[-1] == float("inf")
    assert tr.cuda_graphs.graph.static_inputs[-1].item() == 1.0  # and is reset after it


def test_a_failure_after_the_step_was_applied_is_not_run_again(tr):
    for _ in range(3):
        StepMixin.run_step(tr, batch())
    tr.cuda_graphs.graph.fail_clone_after_replay = True
    with pytest.raises(torch.OutOfMemoryError):
        StepMixin.run_step(tr, batch())
    assert tr.applied == 4  # the replay's step, and no eager rerun of it


def test_a_failure_before_the_step_runs_it_eagerly_and_reports(tr):
    for _ in range(3):
        StepMixin.run_step(tr, batch())
    StepMixin.run_step(tr, batch() * 2)  # two micro-batches: the graph holds one
    assert tr.applied == 4 and len(tr.failures) == 1 and "micro-batches" in tr.failures[0]


def test_a_capture_another_rank_failed_is_dropped_here_too(tr, monkeypatch):
    """Under torchrun a graph holds collectives: every rank replays it or none does."""
    votes = []

    def all_ranks_captured(ok):
        votes.append(ok)
        return False  # this rank captured, the other one did not

    monkeypatch.setattr(tr.cuda_graphs, "_all_ranks_captured", all_ranks_captured)
    for _ in range(3):  # two eager steps, then the warm-up step and the capture
        StepMixin.run_step(tr, batch())
    assert votes == [True] and not tr.cuda_graphs.captured  # asked once, after the capture: dropped
    # the warm-up step was applied and is not run again; the trainer is told why the graph went
    assert tr.applied == 3 and tr.failures == ["capture failed on another rank; every rank runs eagerly"]
