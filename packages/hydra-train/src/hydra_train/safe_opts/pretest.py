"""Pretests: each requested optimization against the safe default (or against the optimizations
it runs on top of), on the real model, from the same weights and the same batches, a few steps each.

An *arm* is a run of ``warmup + steps`` optimizer steps with some optimizations active, on a
throwaway :class:`hydra_train.trainer.Trainer` around the training model (its step, its
non-finite rule, its gradient clipping: the code training runs). Between arms the weights, every
buffer (a step's causal routing records included), the optimizer state and the RNG are restored,
so every arm starts where training will start; after the last arm they are restored once more and
training proceeds as if nothing had run.

Which arms run, in two phases, is :mod:`hydra_train.safe_opts.pretest_arms`. Verdicts follow
:mod:`hydra_train.safe_opts.tolerances`. An exception in an arm (a capture that fails, an
out-of-memory, a kernel that raises) is that optimization's FAIL with the error as the reason.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hydra_train.callbacks import CallbackList, TrainerCallback
from hydra_train.checkpoint import capture_rng, restore_rng
from hydra_train.distributed import broadcast_object
from hydra_train.prefetch import Prefetcher
from hydra_train.safe_opts.arm_limits import ArmTimeout, error_text, time_limit
from hydra_train.safe_opts.faults import FaultInjector
from hydra_train.safe_opts.pretest_arms import FAIL, NA, PASS, Arm, first_arms, stacked_arms
from hydra_train.safe_opts.registry import Optimization
from hydra_train.safe_opts.step0_probe import buffer_values, probe_against, put_back, reference_at
from hydra_train.safe_opts.tolerances import (
    ArmNumbers,
    bounds_for,
    failed_on_speed,
    judge_numerics,
    judge_speed,
)
from hydra_train.trainer import Trainer

__all__ = ["FAIL", "NA", "PASS", "PretestRunner", "PretestSettings"]


@dataclass
class PretestSettings:
    warmup_steps: int = 2
    steps: int = 4
    judge_timing: bool | None = None  # None: judged on CUDA only (see tolerances)
    ref_chunk_rows: int = 2  # rows per chunk of the fp32 reference probe
    #: wall-clock limit of one optimization's arm (compilation included); None: no limit
    arm_timeout_s: float | None = None


class _GraphFailureFailsTheArm(TrainerCallback):
    """In a pretest a CUDA graph that cannot be captured or replayed is the arm's failure."""

    name = "pretest_graph_failure"

    def on_graph_failure(self, step: int, reason: str) -> None:
        raise RuntimeError(f"CUDA graph: {reason}")


@dataclass
class _Snapshot:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    #: every buffer and its value, the state dict's and the rest: a step's leftovers (causal
    #: routing records, statistics) must not reach the next arm's first commit
    buffers: list[tuple[torch.Tensor, torch.Tensor]]


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    return x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PretestRunner:
    def __init__(
        self,
        trainer: Trainer,
        registry: dict[str, Optimization],
        *,
        make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        start_index: int,
        settings: PretestSettings | None = None,
        injector: FaultInjector | None = None,
        log: Callable[[str], None] = print,
    ):
        self.tr, self.reg = trainer, registry
        self.make_batch, self.start = make_batch, int(start_index)
        self.settings = settings or PretestSettings()
        self.injector = injector
        self.log = log
        self.device = trainer.device
        cfg = trainer.model.config
        self.depth = cfg.effective_depth  # block applications (HYDRA) or layers (GPT)
        self.arm_active: tuple[str, ...] = ()

    # -- public --------------------------------------------------------------------------------------
    def run(self, tested: list[str], graph_modes: tuple[str, ...] = ("dynamic",)) -> dict[str, Any]:
        """Pretest ``tested`` (requested names); returns the record body (JSON-able)."""
        for o in self.reg.values():  # every arm starts from the safe defaults
            o.deactivate(self.tr)
        results: dict[str, dict[str, Any]] = {}
        runnable = []
        for name in tested:
            why = self.reg[name].not_applicable(self.tr)
            if why is None:
                runnable.append(name)
            else:
                results[name] = {"status": NA, "reason": why}
        arms = first_arms(self.reg, runnable, graph_modes)
        s = self.settings
        x0, y0 = self.make_batch(self.start)
        probe_tokens = min(s.ref_chunk_rows, x0.shape[0]) * x0.shape[1]
        bounds = bounds_for(
            self.tr.cfg.runtime.precision, probe_tokens, self.depth, self.tr.cfg.optimizations.fp8_format
        )
        body: dict[str, Any] = {
            "settings": dataclasses.asdict(s),
            "bounds": dataclasses.asdict(bounds),
            "depth": self.depth,
            "batch": [int(x0.shape[0]), int(x0.shape[1])],
            "grad_accum": self.tr.cfg.optim.grad_accum,
            "precision": self.tr.cfg.runtime.precision,
        }
        if not arms:
            body["results"] = results
            return body
        snap = self._snapshot()
        numbers: dict[str, ArmNumbers] = {}
        errors: dict[str, str] = {}
        details: dict[str, dict] = {}
        try:
            ref = self._reference(snap, (x0, y0))
            # the scale of every arm's step-0 error: the fp32 reference's loss (this rank's batch)
            # and its whole gradient's norm (summed over the ranks' shards under FSDP2)
            body["reference"] = {"loss": ref["loss"], "grad_norm": ref["norm"]}
            for arm in arms:
                self._timed_arm(arm, snap, ref, numbers, errors, details)
            for arm in arms:
                if not arm.hidden and arm.tested is not None:
                    results[arm.key] = self._verdict(arm, numbers, errors, details, bounds)
            self._confirm_slow(arms, results, snap, ref, numbers, errors, details, bounds)
            # under torchrun every rank must run the same second phase (its steps are collective):
            # rank 0's verdicts decide, as they decide the run (activation.py)
            results = broadcast_object(self.tr.dist, results)
            stacked = stacked_arms(self.reg, runnable, results)
            for arm in stacked:
                if arm.ref in errors:  # the bases failed together: the run must not stack on them
                    results[arm.key] = {
                        "status": FAIL,
                        "ref": arm.ref,
                        "reason": f"not pretested: its reference arm ({arm.ref}) failed: {errors[arm.ref]}",
                    }
                    continue
                self._timed_arm(arm, snap, ref, numbers, errors, details)
                if not arm.hidden:
                    results[arm.key] = self._verdict(arm, numbers, errors, details, bounds)
            self._confirm_slow([*arms, *stacked], results, snap, ref, numbers, errors, details, bounds)
        finally:
            self._restore(snap, final=True)
            del snap
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        body["default"] = dataclasses.asdict(numbers["default"]) if "default" in numbers else None
        body["results"] = results
        return body

    def _confirm_slow(
        self, arms: list[Arm], results, snap: _Snapshot, ref, numbers, errors, details, bounds
    ) -> None:
        """Time again each arm that FAILed on speed alone, right after its reference arm, and let
        the FAIL stand only when this second pair finds it slower too. Arms run one after another
        and a lent host's speed drifts between them: four eager steps each put compile 10%
        behind its reference under DDP on two H100s, and fa3 12% behind once, where every other
        run passed them (packages/hydra-train/BENCHMARKS.md). The second pair's numbers are the
        verdict's; the first's are kept in it as ``first_timing`` (``timed_again`` marks it)."""
        by_key = {a.key: a for a in arms}
        # under torchrun the arms' steps are collective: every rank re-runs rank 0's list
        slow = [
            k
            for k, a in by_key.items()
            if failed_on_speed(results.get(k, {})) and "timed_again" not in results[k] and a.ref in by_key
        ]
        for key in broadcast_object(self.tr.dist, slow):
            arm = by_key[key]
            again: dict[str, ArmNumbers] = {}
            again_errors: dict[str, str] = {}
            for a in (by_key[arm.ref], arm):
                self._timed_arm(a, snap, ref, again, again_errors, {})
            first = results[key]
            if again_errors:
                first["timed_again"] = f"failed: {'; '.join(again_errors.values())}"
                continue
            numbers.update(again)  # the later timings are what a stacked arm's verdict compares with
            second = self._verdict(arm, numbers, errors, details, bounds)
            second.update(timed_again=True, first_timing=first.get("timing"))
            if second["status"] == FAIL and first.get("reason"):
                second["reason"] = f"{second['reason']}; the first timing: {first['reason']}"
            results[key] = second
            self.log(f"[SafeOpts] pretest {key}: timed again after its reference arm: {second['status']}")

    def _timed_arm(self, arm: Arm, snap: _Snapshot, ref, numbers, errors, details) -> None:
        """Run one arm into ``numbers`` and ``details``, or its failure into ``errors``; log its time."""
        t0 = time.perf_counter()
        limit = self.settings.arm_timeout_s if arm.key != "default" else None
        try:
            with time_limit(limit):
                numbers[arm.key], details[arm.key] = self._run_arm(arm, snap, ref)
        except ArmTimeout as exc:
            errors[arm.key] = str(exc)
        except Exception as exc:
            errors[arm.key] = f"error: {error_text(exc)}"
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                errors[arm.key] = "out of memory: " + str(exc).split("\n")[0][:200]
        self.log(
            f"[SafeOpts] pretest arm {arm.key}: "
            + (errors.get(arm.key) or f"{time.perf_counter() - t0:.1f} s")
        )

    # -- arms ----------------------------------------------------------------------------------------
    def _pretest_trainer(self) -> Trainer:
        real = self.tr
        pt = Trainer(
            real.model,
            real.cfg,
            optimizer=real.optimizer,
            schedule=real.schedule.fork(),
            loader=Prefetcher(self.make_batch, self.start, threads=0, device=self.device),
            val_batches=[],
            device=self.device,
            dist_info=real.dist,
            wrapped=real.wrapped,
            callbacks=CallbackList([_GraphFailureFailsTheArm()]),
            log=lambda m: None,
        )
        if self.injector is not None:
            self.injector.install(pt, lambda: self.arm_active, pretest=True)
        return pt

    def _run_arm(self, arm: Arm, snap: _Snapshot, ref) -> tuple[ArmNumbers, dict]:
        s = self.settings
        self._restore(snap)
        pt = self._pretest_trainer()
        tested = self.reg[arm.tested] if arm.tested else None
        late = tested is not None and tested.pretest_activation == "after_warmup"
        graphs = self.reg["cuda_graphs"]
        graphs.warmup = max(1, s.warmup_steps)
        activated: list[Optimization] = []
        out = ArmNumbers()
        detail: dict = {}

        try:
            for name in arm.opts:
                if late and name == arm.tested:
                    continue
                # listed before it runs: an activate that raises halfway is switched back off
                # too (deactivate is idempotent), so that nothing of it reaches training
                activated.append(self.reg[name])
                self.reg[name].activate(pt)
            self.arm_active = tuple(o.name for o in activated)
            if arm.key == "default" or arm.probe or (tested is not None and tested.probe_differs):
                out.probe_loss, err = self._probe(pt, ref)
                if ref is not None:
                    out.probe_grad_err, out.probe_loss_err = err
            n_warm = s.warmup_steps + (tested.pretest_extra_warmup if tested else 0)
            if tested is not None and tested.name == "cuda_graphs":
                n_warm = max(1, s.warmup_steps) + tested.pretest_extra_warmup
            gc.collect()
            gc_was = gc.isenabled()
            gc.disable()  # a collection inside a timed step is noise, not the optimization
            try:
                self._steps(pt, tested, late, n_warm, out, activated)
            finally:
                if gc_was:
                    gc.enable()
            for o in activated:
                detail.update({f"{o.name}.{k}": v for k, v in o.describe().items()})
        finally:
            for o in reversed(activated):
                o.deactivate(pt)
            self.arm_active = ()
            pt.loader.close()
            pt.optimizer.zero_grad(set_to_none=True)
        return out, detail

    def _steps(self, pt: Trainer, tested, late: bool, n_warm: int, out: ArmNumbers, activated: list) -> None:
        s = self.settings
        for t in range(n_warm + s.steps):
            if late and t == s.warmup_steps:
                activated.append(tested)  # before it runs, as in _run_arm
                tested.activate(pt)
                self.arm_active = tuple(o.name for o in activated)
            _sync(self.device)
            t0 = time.perf_counter()
            batches = [pt.loader.next() for _ in range(pt.cfg.optim.grad_accum)]
            res = pt.step_impl(batches)
            pt.schedule.step()
            loss, gn, fin = torch.stack(
                [res.loss.float(), res.grad_norm.float(), res.finite.float()]
            ).tolist()
            dt = (time.perf_counter() - t0) * 1000
            out.losses.append(loss)
            out.grad_norms.append(gn)
            out.finite.append(fin > 0.5)
            if t >= n_warm:
                out.step_ms.append(dt)

    # -- step-0 probe (safe_opts/step0_probe.py) -----------------------------------------------------
    def _reference(self, snap: _Snapshot, batch) -> dict[str, Any]:
        """fp32, safe defaults, no autocast: loss and gradients at the snapshot's weights."""
        self._restore(snap)
        return reference_at(self.tr, batch, self.settings.ref_chunk_rows, self.device)

    def _probe(self, pt: Trainer, ref) -> tuple[float, tuple[float, float] | None]:
        """The arm's loss and, against the reference, (gradient error, loss error) at step 0."""
        return probe_against(pt, self.tr, self.make_batch(self.start), ref, self.device)

    # -- state ----------------------------------------------------------------------------------------
    def _snapshot(self) -> _Snapshot:
        model = {k: v.detach().clone() for k, v in self.tr.model.state_dict().items()}
        opt = _clone_tree(self.tr.optimizer.state_dict())
        return _Snapshot(model, opt, capture_rng(), buffer_values(self.tr.model))

    def _restore(self, snap: _Snapshot, final: bool = False) -> None:
        tr = self.tr
        tr.model.load_state_dict(snap.model)
        put_back(snap.buffers)
        tr.optimizer.load_state_dict(_clone_tree(snap.optimizer))
        tr.optimizer.zero_grad(set_to_none=True)
        restore_rng(snap.rng)
        if final:
            tr.schedule.attach(tr.optimizer)

    # -- verdicts -------------------------------------------------------------------------------------
    def _verdict(self, arm: Arm, numbers, errors, details, bounds) -> dict[str, Any]:
        opt = self.reg[arm.tested]
        res: dict[str, Any] = {"routing": arm.routing, "ref": arm.ref, "details": details.get(arm.key, {})}
        if arm.key in errors:
            return {**res, "status": FAIL, "reason": errors[arm.key]}
        ref_key = arm.ref
        if "default" not in numbers or ref_key not in numbers:
            why = errors.get(ref_key) or errors.get("default") or "reference arm missing"
            return {**res, "status": FAIL, "reason": f"the reference arm failed: {why}"}
        mine, ref, default = numbers[arm.key], numbers[ref_key], numbers["default"]
        res["arm"] = dataclasses.asdict(mine)
        baseline = default
        if opt.pretest_on_top_of and ref.probe_grad_err is not None and default.probe_grad_err is not None:
            # a stacked arm carries its bases' step-0 error (their own pretest bounded it): its
            # bound is taken from the larger of theirs and the safe default's
            baseline = dataclasses.replace(
                default,
                probe_grad_err=max(default.probe_grad_err, ref.probe_grad_err),
                probe_loss_err=max(default.probe_loss_err or 0.0, ref.probe_loss_err or 0.0),
            )
        reason, num_info = judge_numerics(opt.numerics, opt.probe_differs, mine, ref, baseline, bounds)
        own = f"{opt.name}."  # the arm's details carry every active optimization's description
        described = {k.removeprefix(own): v for k, v in res["details"].items() if k.startswith(own)}
        idle = None if reason else opt.no_effect(described)
        if idle is not None:  # the arm ran the reference's own code: no speed verdict to give
            return {**res, "numerics": num_info, "status": NA, "reason": idle}
        judged = opt.numerics != "mode" and (
            self.settings.judge_timing
            if self.settings.judge_timing is not None
            else self.device.type == "cuda"
        )
        slow, speed_info = judge_speed(mine, ref, self.device.type == "cuda", judged)
        speed_info["judged"] = judged
        res.update(numerics=num_info, timing=speed_info)
        reason = reason or slow
        return {**res, "status": FAIL if reason else PASS, "reason": reason}
