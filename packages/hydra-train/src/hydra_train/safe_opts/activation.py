"""SafeOptimizations, first half: applying the optimizations to a built run.

:meth:`ActivationMixin.apply` runs once the model, the optimizer and the trainer are built and a
resume has been applied (before the first evaluation; the runner calls it, the way torchtitan
applies its model converters): every optimization is put to its safe default for real, the
requested ones are classified (OFF, N/A, kept DISABLED from a resumed run), pretested through
:class:`hydra_train.safe_opts.pretest_log.PretestHook` (or trusted with
``--experimental_skip_pretest``), and those that passed are activated in dependency order (CUDA
graphs last, so that they capture what the others set up). The saver is wrapped so that a
checkpoint always holds torch-format optimizer state. What happens after, per step, is the
callback's (:mod:`hydra_train.safe_opts.callback`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hydra_train.config import TrainConfig
from hydra_train.distributed import broadcast_object
from hydra_train.options import train_options
from hydra_train.safe_opts.adam8bit import is_8bit, to_torch_adamw
from hydra_train.safe_opts.monitor import StepReadback
from hydra_train.safe_opts.pretest import FAIL, NA, PASS, PretestRunner, PretestSettings
from hydra_train.safe_opts.pretest_log import environment, fingerprint, timestamp
from hydra_train.safe_opts.registry import ACTIVE_STATES, DISABLED, ENABLED, FAILED, OFF, STABLE, SUSPENDED
from hydra_train.safe_opts.registry import NA as STATUS_NA
from hydra_train.safe_opts.report import reference_of

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
    static = cfg.model.static_routing_mode or cfg.model.model_overrides.get("static_routing_mode")
    return ("dynamic", "static") if static else ("dynamic",)


class ActivationMixin:
    """The build-time half of :class:`hydra_train.safe_opts.callback.SafeOptimizations`."""

    def apply(self, trainer: Trainer) -> None:
        """Apply the requested optimizations to a built run (model, optimizer and any resume in
        place): safe defaults for real, pretests, activation of those that passed."""
        self.trainer = trainer
        self.readback = StepReadback(trainer.device)
        if self.injector is not None:  # tests and HYDRA_SAFEOPTS_INJECT only
            self.injector.install(trainer, self.active_names)
        self._wrap_saver(trainer)
        for o in self.registry.values():  # the safe defaults, for real, whatever the flags built
            o.deactivate(trainer)
        candidates = self._classify(trainer)
        if candidates:
            if self.cfg.optimizations.experimental_skip_pretest:
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
        if cfg.optimizations.compile:
            # the compile arm measures the backend's code (HYDRA_COMPILE_BACKEND), not only --compile
            env["compile_backend"] = train_options().compile_backend
        if trainer.dist.enabled:
            # a pretest under torchrun steps with the collectives (and, under DDP, decides whether
            # the graph holds the gradient averaging): never the same record as one process's
            rt = cfg.runtime
            env.update(world_size=trainer.dist.world_size, fsdp=rt.fsdp, ddp_grad_sync=rt.ddp_grad_sync)
        model_cfg = trainer.model.config.to_dict()
        fp = fingerprint(model_cfg, cfg, env, self.checkpoint)
        decision = (
            self.hook.decide(
                fp,
                cfg.model.model_size,
                self.checkpoint,
                reuse_shared=cfg.optimizations.reuse_pretests,
                needed=names,
            )
            if self._main
            else None
        )
        trigger, cached = broadcast_object(trainer.dist, decision) if self._dist else decision
        if cached is not None:
            results = cached.get("results", {})
            when = cached.get("time")
            if not cached.get("machine_record"):
                self._say(f"[SafeOpts] pretests: same fingerprint as the run of {when}, reusing it")
            else:
                self._say(
                    f"[SafeOpts] pretests: same fingerprint as a run of {when} on this machine "
                    f"({cached['reused_from']}), reusing its verdicts (--no-reuse_pretests pretests again)"
                )
                if self._main:
                    failure = f"could not copy the reused record into {self.hook.log_dir}"
                    self._keep(self.hook.adopt, cached, failure)
        else:
            self._say(f"[SafeOpts] pretests ({trigger}): {', '.join(names)}")
            runner = PretestRunner(
                trainer,
                self.registry,
                make_batch=trainer.loader.make_batch,
                start_index=trainer.loader.position,
                settings=PretestSettings(
                    cfg.optimizations.pretest_warmup_steps, cfg.optimizations.pretest_steps
                ),
                injector=self.injector,
                log=self._say,
            )
            body = runner.run(names, graph_modes_for(cfg))
            if self._dist:
                body = broadcast_object(trainer.dist, body if self._main else None)
            results = body["results"]
            if self._main:
                rec = {
                    "time": timestamp(),  # the history's and the machine's copy
                    "model_size": cfg.model.model_size,
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
                failure = f"pretest record not shared with later runs ({self.hook.shared_dir})"
                self._keep(self.hook.share, rec, failure)
        reused = "cached" if cached is None or "reused_from" not in cached else "machine cache"
        self.pretest_info = {"fingerprint": fp, "trigger": trigger or reused}
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

    def _keep(self, write, rec: dict[str, Any], failure: str) -> None:
        """``write(rec)`` (the machine's copy, or this folder's copy of it): a folder that cannot be
        written costs only that copy, said in the log (under torchrun the other ranks are waiting)."""
        try:
            write(rec)
        except OSError as exc:
            self._say(f"[SafeOpts] {failure}: {exc}")

    def _apply_verdicts(self, names: list[str], results: dict[str, dict[str, Any]]) -> None:
        for n in names:
            r = results.get(n, {"status": FAIL, "reason": "no pretest result"})
            st, why = r.get("status"), r.get("reason")
            timing = r.get("timing") or {}
            ref = reference_of(n, r)
            against = "the default's" if ref == "default" else f"the {ref} arm's"
            extra = f", {timing['speedup']:.2f}x {against} speed" if timing.get("speedup") else ""
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
                # its pretest PASS is in the log and the events: this later N/A must be there too
                self._say(f"[SafeOpts] {n}: N/A once the others are on: {why}")
                self._event("not_applicable", name=n, reason=why)
                continue
            if n == "cuda_graphs":
                o.warmup = self.cfg.optimizations.cuda_graphs_warmup
            o.activate(trainer)
            if self.status[n] == ENABLED and not self.attribution.in_window(n):
                self.attribution.start(n, trainer.step)
        for n in self.registry:
            # a SUSPENDED one (resumed in the middle of its isolation trial) stays off until the
            # trial decides; stopping it here would drop the trial and leave it suspended for good
            if self.status[n] not in ACTIVE_STATES and self.status[n] != SUSPENDED:
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
