"""Fault-injection grammar, firing only while the optimization is active, and the dispatcher."""

from __future__ import annotations

import math
import time

import pytest
import torch

from hydra_train.errors import HydraTrainError
from hydra_train.safe_opts.faults import ENV, FaultInjector, PoisonHook, StepDispatcher
from hydra_train.safe_opts.registry import NAMES
from hydra_train.trainer import StepResult


def test_grammar():
    inj = FaultInjector.parse(
        "nan_grad:compile@step5, loss_spike=20:fa3@step10-12,slow=0.5:prefetch_threads@step8+,"
        "inf_grad:fp8@always,nan_grad:static_routing@pretest",
        known=NAMES,
    )
    f = {x.opt: x for x in inj.faults}
    assert (f["compile"].kind, f["compile"].first, f["compile"].last) == ("nan_grad", 5, 5)
    assert (f["fa3"].value, f["fa3"].first, f["fa3"].last) == (20.0, 10, 12)
    assert f["prefetch_threads"].first == 8 and f["prefetch_threads"].last == math.inf
    assert f["fp8"].value == math.inf and f["fp8"].first == 1
    assert f["static_routing"].pretest


@pytest.mark.parametrize(
    "spec",
    [
        "nan:compile@step5",
        "nan_grad:compile",
        "nan_grad:compile@stepX",
        "nan_grad:nothing@step1",
        "slow=x:fa3@always",
    ],
)
def test_bad_entries_name_the_problem(spec):
    with pytest.raises(HydraTrainError, match=ENV):
        FaultInjector.parse(spec, known=NAMES)


def test_fires_only_while_active_and_in_its_phase():
    inj = FaultInjector.parse("nan_grad:compile@step3-4,loss_spike:fa3@pretest")
    assert inj.at(3, {"compile"}).poison is not None and math.isnan(inj.at(4, {"compile"}).poison)
    assert inj.at(3, {"fa3"}).poison is None  # compile off: no fault
    assert inj.at(5, {"compile"}).poison is None
    assert inj.at(1, {"fa3"}).spike is None and inj.at(1, {"fa3"}, pretest=True).spike == 10.0
    assert inj.fired == {("nan_grad", "compile"): 2, ("loss_spike", "fa3"): 1}


def test_env(monkeypatch):
    monkeypatch.setenv(ENV, "slow=0.1:compile@always")
    assert FaultInjector.from_env(NAMES).faults[0].value == 0.1
    monkeypatch.delenv(ENV)
    assert FaultInjector.from_env(NAMES) is None


class _Eager:
    """The eager step's contract as far as the dispatcher sees it: calls on_after_backward."""

    def __init__(self):
        self.step = 6
        self.w = torch.nn.Parameter(torch.ones(3))
        self.hook = PoisonHook()

    def eager_step(self, batches):
        self.w.grad = torch.ones(3)
        self.hook.on_after_backward(self.step + 1, self)
        gn = self.w.grad.norm()
        return StepResult(torch.tensor(2.0), torch.tensor(2.0), {}, gn, torch.isfinite(gn))

    def parameters(self):
        return [self.w]


class _NoGraph:
    def run_step(self, trainer, batches, poison):
        return None


def test_dispatcher_applies_poison_spike_and_sleep():
    tr = _Eager()
    inj = FaultInjector.parse("inf_grad:compile@step7,loss_spike=4:compile@step7,slow=0.15:compile@step7")
    d = StepDispatcher(tr, _NoGraph(), lambda: ("compile",), inj, tr.hook, lambda m: None)
    t0 = time.perf_counter()
    res = d([])
    assert time.perf_counter() - t0 >= 0.15
    assert not bool(res.finite) and float(res.loss) == 8.0 and tr.hook.pending is None
    tr.step = 7  # next step: nothing fires
    res = d([])
    assert bool(res.finite) and float(res.loss) == 2.0


def test_dispatcher_reports_a_graph_failure_and_runs_eagerly():
    class Broken:
        def run_step(self, trainer, batches, poison):
            raise RuntimeError("capture invalidated")

    seen = []
    tr = _Eager()
    res = StepDispatcher(tr, Broken(), lambda: (), None, tr.hook, seen.append)([])
    assert bool(res.finite) and seen == ["RuntimeError: capture invalidated"]
