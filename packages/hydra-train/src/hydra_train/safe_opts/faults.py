"""Fault injection tied to one optimization, for tests and for checking a machine by hand.

A fault fires only in steps where its optimization is active, so switching that optimization off
really stops it: that is what proves the fallback is real. Nothing here is on the normal step
path: :meth:`FaultInjector.install` wraps a trainer's ``step_impl`` only when faults are given,
from tests (``SafeOptimizations(fault_injector=FaultInjector.parse(...))``) or from the option
``inject_faults`` of :mod:`hydra_train.options`, that is from code or from the environment::

    HYDRA_SAFEOPTS_INJECT="nan_grad:compile@step5,loss_spike=20:fa3@step10-12,slow=0.3:prefetch_threads@step8+"

Entry grammar ``KIND[=VALUE]:OPTIMIZATION@WHEN``:

============  ======================================================================
nan_grad      a NaN in one gradient (eager: after backward, before the finiteness
              check; CUDA graph: a NaN multiplied into the captured loss)
inf_grad      the same with +Inf
loss_spike=F  the loss the monitor reads is multiplied by F (default 10); the weights
              are not touched, so a clean run and a faulted one stay comparable
slow=S        the step sleeps S seconds (default 0.25) on the host
============  ======================================================================

WHEN: ``stepN`` (optimizer step N, counted from 1 like the logs), ``stepN-M`` (inclusive),
``stepN+``, ``always``, or ``pretest`` (every step of that optimization's pretest, so pretest
failures can be tested too).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from hydra_train.callbacks import TrainerCallback
from hydra_train.errors import HydraTrainError
from hydra_train.options import train_options

if TYPE_CHECKING:
    from hydra_train.step import StepResult
    from hydra_train.trainer import Trainer

ENV = "HYDRA_SAFEOPTS_INJECT"
KINDS = {"nan_grad": math.nan, "inf_grad": math.inf, "loss_spike": 10.0, "slow": 0.25}
_ENTRY = re.compile(r"^(?P<kind>[a-z_]+)(?:=(?P<value>[0-9.eE+-]+))?:(?P<opt>[0-9a-z_]+)@(?P<when>.+)$")
_WHEN = re.compile(r"^step(?P<a>\d+)(?:(?P<plus>\+)|-(?P<b>\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    opt: str
    value: float
    first: int = 1
    last: float = math.inf
    pretest: bool = False

    def fires(self, step: int, active: Iterable[str], pretest: bool) -> bool:
        if self.opt not in active or pretest != self.pretest:
            return False
        return pretest or self.first <= step <= self.last


@dataclass
class StepFaults:
    poison: float | None = None  # NaN / Inf into the gradients
    spike: float | None = None  # factor on the reported loss
    sleep: float = 0.0


class FaultInjector:
    def __init__(self, faults: Iterable[Fault] = ()):
        self.faults = list(faults)
        self.fired: Counter[tuple[str, str]] = Counter()  # (kind, optimization) -> times

    @classmethod
    def parse(cls, spec: str, known: Iterable[str] | None = None) -> FaultInjector:
        faults = []
        for raw in filter(None, (e.strip() for e in spec.split(","))):
            m = _ENTRY.match(raw)
            if not m or m["kind"] not in KINDS:
                raise HydraTrainError(
                    f"{ENV}: bad entry {raw!r}; expected KIND[=VALUE]:OPTIMIZATION@WHEN with KIND one of "
                    f"{', '.join(KINDS)}, e.g. nan_grad:compile@step5"
                )
            if known is not None and m["opt"] not in set(known):
                raise HydraTrainError(f"{ENV}: unknown optimization {m['opt']!r} in {raw!r}")
            value = float(m["value"]) if m["value"] else KINDS[m["kind"]]
            f = Fault(m["kind"], m["opt"], value)
            when = m["when"]
            if when == "pretest":
                f = replace(f, pretest=True)
            elif when != "always":
                w = _WHEN.match(when)
                if not w:
                    raise HydraTrainError(
                        f"{ENV}: bad WHEN {when!r} in {raw!r}; use stepN, stepN-M, stepN+, always or pretest"
                    )
                a = int(w["a"])
                b = math.inf if w["plus"] else int(w["b"]) if w["b"] else a
                f = replace(f, first=a, last=b)
            faults.append(f)
        return cls(faults)

    @classmethod
    def from_options(cls, known: Iterable[str] | None = None) -> FaultInjector | None:
        """The injector the option ``inject_faults`` (``HYDRA_SAFEOPTS_INJECT``) asks for, if any."""
        spec = train_options().inject_faults
        return cls.parse(spec, known) if spec else None

    def install(
        self, trainer: Trainer, active: Callable[[], Iterable[str]], *, pretest: bool = False
    ) -> FaultyStep:
        """Wrap ``trainer.step_impl`` so that this injector's faults fire in its steps while their
        optimization is among ``active()``; returns the wrapper."""
        wrapper = FaultyStep(trainer, trainer.step_impl, self, active, pretest=pretest)
        trainer.step_impl = wrapper
        return wrapper

    def at(self, step: int, active: Iterable[str], pretest: bool = False) -> StepFaults:
        active = set(active)
        out = StepFaults()
        for f in self.faults:
            if not f.fires(step, active, pretest):
                continue
            self.fired[(f.kind, f.opt)] += 1
            if f.kind in ("nan_grad", "inf_grad"):
                out.poison = f.value
            elif f.kind == "loss_spike":
                out.spike = f.value
            else:
                out.sleep += f.value
        return out


def poison_gradients(model: torch.nn.Module, value: float) -> None:
    p = next((p for p in model.parameters() if p.grad is not None), None)
    if p is not None:
        p.grad.view(-1)[0] = value


class PoisonHook(TrainerCallback):
    """Puts ``value`` into one gradient after the eager step's backward (``on_after_backward``).
    :class:`FaultyStep` adds it to the trainer's callbacks for one step only."""

    name = "safe_opts_poison"

    def __init__(self, value: float):
        self.value = value

    def on_after_backward(self, step: int, model: torch.nn.Module) -> None:
        poison_gradients(model, self.value)


class FaultyStep:
    """``trainer.step_impl`` while a :class:`FaultInjector` is installed: the step that was there,
    with this step's faults applied around it. Poison reaches an eager step through a
    :class:`PoisonHook` added for that step, and a graphed one through the graph's loss scale."""

    def __init__(
        self,
        trainer: Trainer,
        inner: Callable[[list], StepResult],
        injector: FaultInjector,
        active: Callable[[], Iterable[str]],
        *,
        pretest: bool = False,
    ):
        self.tr, self.inner, self.injector = trainer, inner, injector
        self.active, self.pretest = active, pretest
        self.count = 0

    def __call__(self, batches: list) -> StepResult:
        self.count += 1
        step = self.count if self.pretest else self.tr.step + 1
        faults = self.injector.at(step, self.active(), self.pretest)
        hook = None
        if faults.poison is not None:
            hook = PoisonHook(faults.poison)
            self.tr.callbacks.add(hook)
            graphs = getattr(self.tr, "cuda_graphs", None)
            if graphs is not None:
                graphs.scale_next_loss(faults.poison)
        try:
            res = self.inner(batches)
        finally:
            if hook is not None:
                self.tr.callbacks.remove(hook)
        if faults.spike is not None:
            res = replace(res, loss=res.loss * faults.spike)
        if faults.sleep:
            time.sleep(faults.sleep)
        return res
