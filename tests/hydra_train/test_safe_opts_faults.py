"""Fault-injection grammar, firing only while the optimization is active, the installed wrapper,
and the trainer's graph fallback."""

from __future__ import annotations

import math
import time

import pytest
import torch

from hydra_train.callbacks import CallbackList, TrainerCallback
from hydra_train.errors import HydraTrainError
from hydra_train.safe_opts.faults import ENV, FaultInjector
from hydra_train.safe_opts.registry import NAMES
from hydra_train.step import StepResult


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
    assert FaultInjector.from_options(NAMES).faults[0].value == 0.1
    monkeypatch.delenv(ENV)
    assert FaultInjector.from_options(NAMES) is None


class _Eager:
    """The trainer as far as the fault wrapper sees it: a step number, callbacks, and a step that
    calls on_after_backward between backward and the finiteness check."""

    def __init__(self):
        self.step = 6
        self.w = torch.nn.Parameter(torch.ones(3))
        self.callbacks = CallbackList()
        self.cuda_graphs = None

    def eager_step(self, batches):
        self.w.grad = torch.ones(3)
        self.callbacks.call("on_after_backward", self.step + 1, self)
        gn = self.w.grad.norm()
        return StepResult(torch.tensor(2.0), torch.tensor(2.0), {}, gn, torch.isfinite(gn))

    def parameters(self):
        return [self.w]


def test_installed_faults_poison_spike_and_sleep():
    tr = _Eager()
    tr.step_impl = tr.eager_step
    inj = FaultInjector.parse("inf_grad:compile@step7,loss_spike=4:compile@step7,slow=0.15:compile@step7")
    step = inj.install(tr, lambda: ("compile",))
    assert tr.step_impl is step
    t0 = time.perf_counter()
    res = tr.step_impl([])
    assert time.perf_counter() - t0 >= 0.15
    assert not bool(res.finite) and float(res.loss) == 8.0
    assert len(tr.callbacks) == 0  # the poison hook was there for that step only
    tr.step = 7  # next step: nothing fires
    res = tr.step_impl([])
    assert bool(res.finite) and float(res.loss) == 2.0


def test_a_graph_failure_is_reported_and_the_step_runs_eagerly(tmp_path):
    from .test_safe_opts_pretest import make_trainer

    class Broken:
        failure = None
        step_applied = False  # it fails before its optimizer step

        def take_eager_step(self):
            return False

        def __call__(self, batches):
            raise RuntimeError("capture invalidated")

        def release(self):
            pass

    class Seen(TrainerCallback):
        name = "seen"

        def __init__(self):
            self.reports = []

        def on_graph_failure(self, step, reason):
            self.reports.append((step, reason))

    tr, _ = make_trainer(tmp_path)
    seen = Seen()
    tr.callbacks.add(seen)
    tr.cuda_graphs = Broken()
    res = tr.step_impl([tr.loader.next()])
    assert bool(res.finite) and seen.reports == [(1, "RuntimeError: capture invalidated")]
    assert tr.cuda_graphs is None and tr.graph_failures == ["RuntimeError: capture invalidated"]
