"""SafeOptimizations: the trainer callback that pretests, activates, monitors and falls back.

Where it plugs in (the runtime's seams): ``trainer.step_impl`` becomes a
:class:`hydra_train.safe_opts.faults.StepDispatcher` (the CUDA-graph step or the eager one);
``trainer.forward_model``, ``trainer.set_optimizer``, ``trainer.loader`` and the model's modules
are what the optimizations switch; ``trainer.saver`` is wrapped so that a checkpoint always
holds torch-format optimizer state; the callback's state goes into checkpoints under
``callbacks["safe_opts"]``.

At ``on_train_start`` (after a resume has been applied, before the first evaluation): every
optimization is put to its safe default for real, the requested ones are classified (OFF, N/A,
kept DISABLED from a resumed run), pretested through :class:`PretestHook` (or trusted with
``--experimental_skip_pretest``), and those that passed are activated in dependency order (CUDA
graphs last, so that they capture what the others set up). Then, per step, the monitor
(:mod:`hydra_train.safe_opts.monitor`) feeds :mod:`hydra_train.safe_opts.attribution`, whose
actions are carried out here for real. ``SafeOptimizations status: {...}`` is printed at start,
on every change and at the end.

Under DDP/FSDP every rank runs the pretests (their forward/backward are collective), rank 0's
verdicts are broadcast, rank 0 alone watches for anomalies, and every decision is applied on all
ranks at the next log interval, so the ranks never run different models.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_train.callbacks import TrainerCallback
from hydra_train.config import TrainConfig
from hydra_train.distributed import broadcast_object
from hydra_train.safe_opts.adam8bit import is_8bit, to_torch_adamw
from hydra_train.safe_opts.attribution import Action, Anomaly, Attribution
from hydra_train.safe_opts.faults import FaultInjector, PoisonHook, StepDispatcher
from hydra_train.safe_opts.monitor import Detectors, StepReadback
from hydra_train.safe_opts.pretest import FAIL, NA, PASS, PretestRunner, PretestSettings
from hydra_train.safe_opts.pretest_log import PretestHook, environment, fingerprint
from hydra_train.safe_opts.registry import (
    ACTIVE_STATES,
    DISABLED,
    ENABLED,
    FAILED,
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

#: Activation order: the model's own computation first, CUDA graphs last (they capture the rest).
ACTIVATION_ORDER = (
    "static_routing",
    "fp8",
    "triton_kernels",
    "fa3",
    "blackwell_tuning",
    "compile",
    "8bit_adam",
    "prefetch_threads",
    "cuda_graphs",
)


def graph_modes_for(cfg: TrainConfig) -> tuple[str, ...]:
    """Routing modes to pretest CUDA graphs in: dynamic always, static too when it is requested."""
    static = cfg.static_routing_mode or cfg.model_overrides.get("static_routing_mode")
    return ("dynamic", "static") if static else ("dynamic",)


class SafeOptimizations(TrainerCallback):
    name = "safe_opts"

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        log_dir: str | Path | None = None,
        fault_injector: FaultInjector | None = None,
        log=print,
    ):
        self.cfg = cfg
        self.registry = build_registry(cfg)
        self.status = {n: PENDING if o.requested() else OFF for n, o in self.registry.items()}
        self.reasons: dict[str, str] = {}
        self.attribution = Attribution(
            cfg.experimental_safety_window, {n: o.causes for n, o in self.registry.items()}, NAMES
        )
        self.detectors = Detectors(
            cfg.experimental_loss_spike_threshold, cfg.experimental_throughput_drop_threshold
        )
        self.injector = fault_injector if fault_injector is not None else FaultInjector.from_env(NAMES)
        self.hook = PretestHook(log_dir if log_dir is not None else Path(cfg.checkpoint_dir) / "pretest_logs")
        self.log = log
        self.checkpoint: str | None = None  # "path@step" of a resumed checkpoint (set by the runner)
        self.poison = PoisonHook()
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
        ev = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": step, "event": event, **fields}
        self.events.append(ev)
        del self.events[:-500]
        if self._main:
            self.hook.log_event(ev)

    # -- start ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.readback = StepReadback(trainer.device)
        trainer.step_impl = StepDispatcher(
            trainer,
            self.registry["cuda_graphs"],
            self.active_names,
            self.injector,
            self.poison,
            self._graph_failed,
        )
        self._wrap_saver(trainer)
        for o in self.registry.values():  # the safe defaults, for real, whatever the flags built
            o.deactivate(trainer)
        candidates = self._classify(trainer)
        if candidates:
            if self.cfg.experimental_skip_pretest:
                self._say(
                    f"[SafeOpts] pretests skipped (--experimental_skip_pretest): {', '.join(candidates)}"
                )
                for n in candidates:
                    self.status[n] = STABLE if self.status[n] == STABLE else ENABLED
            else:
                self._apply_verdicts(candidates, self._pretest(trainer, candidates))
        self._activate_all(trainer)
        self.print_status()

    def _classify(self, trainer: Trainer) -> list[str]:
        out = []
        for n, o in self.registry.items():
            if not o.requested():
                self.status[n] = OFF
                continue
            if self.status[n] in (DISABLED, SUSPENDED):  # the monitor's decision survives a resume
                continue
            why = o.not_applicable(trainer)
            if why is not None:
                self.status[n], self.reasons[n] = STATUS_NA, why
                continue
            out.append(n)
        return out

    def _pretest(self, trainer: Trainer, names: list[str]) -> dict[str, dict[str, Any]]:
        cfg = self.cfg
        env = environment(trainer.device)
        model_cfg = trainer.model.config.to_dict()
        fp = fingerprint(model_cfg, cfg, env, self.checkpoint)
        decision = self.hook.decide(fp, cfg.model_size, self.checkpoint) if self._main else None
        trigger, cached = broadcast_object(trainer.dist, decision) if self._dist else decision
        if cached is not None:
            self._say(f"[SafeOpts] pretests: same fingerprint as the run of {cached.get('time')}, reusing it")
            results = cached.get("results", {})
        else:
            self._say(f"[SafeOpts] pretests ({trigger}): {', '.join(names)}")
            runner = PretestRunner(
                trainer,
                self.registry,
                make_batch=trainer.loader.make_batch,
                start_index=trainer.loader.position,
                settings=PretestSettings(cfg.pretest_warmup_steps, cfg.pretest_steps),
                injector=self.injector,
                log=self._say,
            )
            body = runner.run(names, graph_modes_for(cfg))
            if self._dist:
                body = broadcast_object(trainer.dist, body if self._main else None)
            results = body["results"]
            if self._main:
                rec = {
                    "model_size": cfg.model_size,
                    "fingerprint": fp,
                    "trigger": trigger,
                    "checkpoint": self.checkpoint,
                    "env": env,
                    "config": {"model": model_cfg, **{k: getattr(cfg, k) for k in ("batch_size", "seq_len")}},
                    "requested": names,
                    "source": "hydra-train run",
                    **body,
                }
                self.hook.record(rec)
        self.pretest_info = {"fingerprint": fp, "trigger": trigger or "cached"}
        static = (
            self.registry["static_routing"].requested()
            and results.get("static_routing", {}).get("status") == PASS
        )
        if "cuda_graphs" in names:  # the verdict of the routing mode training will use
            key = "cuda_graphs[static]" if static else "cuda_graphs"
            results = {
                **results,
                "cuda_graphs": results.get(key, {"status": FAIL, "reason": "not pretested"}),
            }
        return results

    def _apply_verdicts(self, names: list[str], results: dict[str, dict[str, Any]]) -> None:
        for n in names:
            r = results.get(n, {"status": FAIL, "reason": "no pretest result"})
            st, why = r.get("status"), r.get("reason")
            timing = r.get("timing") or {}
            extra = f", {timing['speedup']:.2f}x the default's speed" if timing.get("speedup") else ""
            self._say(f"[SafeOpts] pretest {n}: {st}" + (f": {why}" if why else extra))
            if st == PASS:
                self.status[n] = STABLE if self.status[n] == STABLE else ENABLED
                self.reasons.pop(n, None)
            elif st == NA:
                self.status[n], self.reasons[n] = STATUS_NA, why or ""
            else:
                self.status[n], self.reasons[n] = FAILED, why or "failed"
            self._event("pretest", name=n, status=st, reason=why)

    def _activate_all(self, trainer: Trainer) -> None:
        for n in ACTIVATION_ORDER:
            if self.status[n] not in ACTIVE_STATES:
                continue
            o = self.registry[n]
            why = o.not_applicable(trainer)  # e.g. CUDA graphs once 8-bit Adam is in
            if why is not None:
                self.status[n], self.reasons[n] = STATUS_NA, why
                self.attribution.stop(n)
                continue
            if n == "cuda_graphs":
                o.warmup = self.cfg.cuda_graphs_warmup
            o.activate(trainer)
            if self.status[n] == ENABLED and not self.attribution.in_window(n):
                self.attribution.start(n, trainer.step)
        for n in self.registry:
            if self.status[n] not in ACTIVE_STATES:
                self.attribution.stop(n)

    def _wrap_saver(self, trainer: Trainer) -> None:
        inner = trainer.saver
        if inner is None or getattr(inner, "safe_opts_wrapped", False):
            return

        def saver(tr: Trainer, final: bool):
            self._drain(block=True)
            if not is_8bit(tr.optimizer):
                return inner(tr, final)
            real = tr.optimizer  # checkpoints hold torch-format state (see adam8bit)
            tr.optimizer = to_torch_adamw(real, fused=True, state_device="cpu")
            try:
                return inner(tr, final)
            finally:
                tr.optimizer = real

        saver.safe_opts_wrapped = True
        trainer.saver = saver

    # -- per step ---------------------------------------------------------------------------------
    def on_after_backward(self, step: int, model) -> None:
        self.poison.on_after_backward(step, model)

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
                    o.warmup = self.cfg.cuda_graphs_warmup
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

    def _graph_failed(self, msg: str) -> None:
        o = self.registry["cuda_graphs"]
        o.deactivate(self.trainer)
        self.attribution.stop("cuda_graphs")
        self.status["cuda_graphs"], self.reasons["cuda_graphs"] = DISABLED, f"CUDA graph failed: {msg}"
        self._say(f"[SafeOpts] cuda_graphs disabled: {msg}; this step and the next run eagerly")
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
