"""SafeOptimizations: every optional optimization applied to a built run, pretested, monitored,
and switched off with a reason when it misbehaves.

Two halves: :mod:`hydra_train.safe_opts.activation` applies them (``SafeOptimizations.apply``, called
by the runner once the model, optimizer and trainer are built and a resume is applied: safe
defaults, pretests, activation); this module is the callback that watches them. Per step the
monitor (:mod:`hydra_train.safe_opts.monitor`) feeds :mod:`hydra_train.safe_opts.attribution`, whose
actions (disable, suspend, re-enable, graduate) are carried out here for real; a CUDA graph the
trainer had to drop (``on_graph_failure``) is recorded DISABLED. ``SafeOptimizations status:
{...}`` is printed at start, on every change and at the end. The callback's state goes into
checkpoints under ``callbacks["safe_opts"]``.

Under DDP/FSDP every rank runs the pretests (their forward/backward are collective), rank 0's
verdicts are broadcast, rank 0 alone watches for anomalies, and every decision is applied on all
ranks at the next log interval, so the ranks never run different models.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_train.callbacks import TrainerCallback
from hydra_train.config import TrainConfig
from hydra_train.distributed import broadcast_object
from hydra_train.safe_opts.activation import ACTIVATION_ORDER, ActivationMixin, graph_modes_for
from hydra_train.safe_opts.attribution import Action, Anomaly, Attribution
from hydra_train.safe_opts.faults import FaultInjector
from hydra_train.safe_opts.monitor import Detectors, StepReadback
from hydra_train.safe_opts.pretest_log import PretestHook, event_time
from hydra_train.safe_opts.registry import (
    DISABLED,
    ENABLED,
    NAMES,
    OFF,
    PENDING,
    STABLE,
    SUSPENDED,
    build_registry,
)
from hydra_train.safe_opts.registry import NA as STATUS_NA

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer

__all__ = ["ACTIVATION_ORDER", "SafeOptimizations", "graph_modes_for"]


class SafeOptimizations(ActivationMixin, TrainerCallback):
    name = "safe_opts"

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        log_dir: str | Path | None = None,
        shared_dir: str | Path | None = None,
        fault_injector: FaultInjector | None = None,
        log=print,
    ):
        self.cfg = cfg
        self.registry = build_registry(cfg)
        self.status = {n: PENDING if o.requested() else OFF for n, o in self.registry.items()}
        self.reasons: dict[str, str] = {}
        self.attribution = Attribution(
            cfg.optimizations.experimental_safety_window,
            {n: o.causes for n, o in self.registry.items()},
            NAMES,
        )
        self.detectors = Detectors(
            cfg.optimizations.experimental_loss_spike_threshold,
            cfg.optimizations.experimental_throughput_drop_threshold,
        )
        self.injector = fault_injector if fault_injector is not None else FaultInjector.from_options(NAMES)
        self.hook = PretestHook(
            log_dir if log_dir is not None else Path(cfg.runtime.checkpoint_dir) / "pretest_logs",
            shared_dir,  # the machine's records, shared by runs (hydra-train run passes them)
        )
        self.log = log
        self.checkpoint: str | None = None  # "path@step" of a resumed checkpoint (set by the runner)
        self.events: list[dict[str, Any]] = []
        self.pretest_info: dict[str, Any] = {}
        self.trainer: Trainer | None = None
        self.readback: StepReadback | None = None
        self._deferred: list[Action] = []

    def configure(self, cfg: TrainConfig) -> None:
        """Use the resolved config (the runner calls this; the flags themselves never auto-resolve)."""
        self.cfg = cfg
        for o in self.registry.values():
            o.cfg = cfg

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def _main(self) -> bool:
        return self.trainer is None or self.trainer.dist.is_main

    @property
    def _dist(self) -> bool:
        return self.trainer is not None and self.trainer.dist.enabled

    def active_names(self) -> tuple[str, ...]:
        return tuple(n for n in NAMES if self.registry[n].active)

    def _say(self, msg: str) -> None:
        if self._main:
            self.log(msg)

    def print_status(self) -> None:
        self._say(f"SafeOptimizations status: {dict(self.status)}")

    def _event(self, event: str, **fields: Any) -> None:
        step = self.trainer.step if self.trainer is not None else 0
        # the log's own time (UTC), so that the events kept here and in checkpoints read as the
        # log's do, and no local stamp is converted after the fact (a DST change's repeated hour)
        ev = {"time": event_time(), "step": step, "event": event, **fields}
        self.events.append(ev)
        del self.events[:-500]
        if self._main:
            self.hook.log_event(ev)

    # -- per step ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer) -> None:
        if self.trainer is not trainer:
            raise RuntimeError(
                "SafeOptimizations.apply(trainer) must run before training (hydra_train.run does it)"
            )

    def on_step_end(self, step: int, metrics) -> None:
        if not self._main:
            return
        self.readback.push(step, self.active_names(), metrics.loss, metrics.grad_norm, metrics.finite)
        self._drain(block=False)

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        if self._main:
            self._drain(block=True)
            self._observe(
                step, self.active_names(), self.detectors.interval_anomalies(step, row["tokens_per_s"]), False
            )
        if self._dist:
            actions = broadcast_object(self.trainer.dist, self._deferred if self._main else None)
            self._deferred = []
            for act in actions:
                self._apply(act)

    def _drain(self, block: bool) -> None:
        if self.readback is None or not self._main:
            return
        for step, active, (loss, gn, fin) in self.readback.ready(block):
            self._observe(step, active, self.detectors.step_anomalies(step, loss, gn, fin), True)

    def _observe(
        self, step: int, active: tuple[str, ...], anomalies: list[Anomaly], count_clean: bool
    ) -> None:
        attributions, actions = self.attribution.observe(step, active, anomalies, count_clean=count_clean)
        for name, a in attributions:
            if name is None:
                self._say(
                    f"[SafeOpts] anomaly at step {a.step}: {a.kind} (value={a.value:.4f}); "
                    "no optimization in its safety window"
                )
            else:
                self._say(f"[SafeOpts] {name} anomaly: {a.kind} (value={a.value:.4f})")
            base = None if a.baseline is None or not math.isfinite(a.baseline) else a.baseline
            self._event("anomaly", name=name, kind=a.kind, value=a.value, baseline=base, at_step=a.step)
        for act in actions:
            if self._dist:
                self._deferred.append(act)
            else:
                self._apply(act)

    def _apply(self, act: Action) -> None:
        tr, o, n = self.trainer, self.registry[act.name], act.name
        if act.kind == "graduate":
            if self.status[n] == ENABLED:
                self.status[n] = STABLE
        elif act.kind in ("disable", "suspend"):
            if o.active:
                o.deactivate(tr)
            if act.kind == "disable":
                self.attribution.stop(n)
            self.status[n] = DISABLED if act.kind == "disable" else SUSPENDED
            self.reasons[n] = act.reason
            self._say(f"[SafeOpts] {n} {'disabled' if act.kind == 'disable' else 'suspended'}: {act.reason}")
            self._switched(o)
        elif act.kind == "reenable":
            why = o.not_applicable(tr)
            if why is not None:
                self.status[n], self.reasons[n] = STATUS_NA, why
            else:
                if n == "cuda_graphs":
                    o.warmup = self.cfg.optimizations.cuda_graphs_warmup
                o.activate(tr)
                self.status[n] = ENABLED
                self.reasons.pop(n, None)
                self.attribution.start(n, tr.step)
                self._say(f"[SafeOpts] {n} re-enabled: {act.reason}")
                self._switched(o)
        self._event(act.kind, name=n, reason=act.reason)
        self.print_status()

    def _switched(self, changed) -> None:
        for o in self.registry.values():
            if o is not changed and o.active:
                o.invalidate(self.trainer)
        self.detectors.switched()

    def on_graph_failure(self, step: int, reason: str) -> None:
        """The trainer dropped its CUDA graph (capture or replay failed): recorded as DISABLED."""
        o = self.registry["cuda_graphs"]
        o.deactivate(self.trainer)  # the trainer already runs eagerly; this marks it inactive
        self.attribution.stop("cuda_graphs")
        self.status["cuda_graphs"], self.reasons["cuda_graphs"] = DISABLED, f"CUDA graph failed: {reason}"
        self._say(f"[SafeOpts] cuda_graphs disabled: {reason}; the step runs eagerly from now on")
        self._event("disable", name="cuda_graphs", reason=self.reasons["cuda_graphs"])
        self.detectors.switched()
        self.print_status()

    # -- end, checkpoints -----------------------------------------------------------------------------
    def on_train_end(self, summary: dict[str, Any]) -> None:
        self._drain(block=True)
        self.print_status()
        summary["safe_opts"] = dict(self.status)
        summary["safe_opts_reasons"] = dict(self.reasons)
        if self.registry["8bit_adam"].active:
            summary["optimizer"] = "adamw8bit"
        if self.trainer is not None:
            for o in self.registry.values():  # leave the process-wide switches at their defaults
                if o.active and o.name in ("fa3", "triton_kernels", "blackwell_tuning"):
                    o.deactivate(self.trainer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "status": dict(self.status),
            "reasons": dict(self.reasons),
            "attribution": self.attribution.state_dict(),
            "detectors": self.detectors.state_dict(),
            "events": list(self.events[-200:]),
            "pretest": dict(self.pretest_info),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, st in state.get("status", {}).items():
            if n in self.status and self.registry[n].requested():
                self.status[n] = st
        self.reasons.update({n: r for n, r in state.get("reasons", {}).items() if n in self.status})
        self.attribution.load_state_dict(state.get("attribution", {}))
        if "detectors" in state:
            self.detectors.load_state_dict(state["detectors"])
        self.events = list(state.get("events", []))
        self.pretest_info = dict(state.get("pretest", {}))
