"""Who is to blame for an anomaly: safety windows, counting, isolation trials, graduation.

Pure bookkeeping over ``(step, optimizations active in that step, anomalies of that step)``;
:class:`hydra_train.safe_opts.callback.SafeOptimizations` carries out the actions it returns.

**Attribution rule.** An anomaly of step s is attributed to every optimization that was active in
step s, is still inside its safety window (activated, not yet graduated) and can cause that kind
of anomaly (``Optimization.causes``: background prefetching only changes when a batch is built,
never what it holds, so only throughput drops are blamed on it). Each attributed optimization
counts the anomaly; anomalies older than ``window`` steps are forgotten.

**Disabling.** When an optimization has counted ``max_anomalies`` (3) anomalies:

* if no other optimization shared any of them, it alone was active and capable: it is disabled;
* otherwise the evidence cannot tell the suspects apart (they ran in the same steps), so an
  isolation trial decides: the most recently activated suspect (ties broken by the registry's risk
  order) is *suspended*, i.e. switched off for real, and the shared anomalies are cleared from
  every suspect's count. If an anomaly of the same kind happens again while it is off, it is
  exonerated and switched back on with a fresh window; if none happens within the trial length
  (twice the span over which its anomalies came, at least 5 steps, at most the window, counted
  in steps that ran without it), it is disabled. With a fault that persists, this converges on
  the optimization that causes it, and the innocent ones end up back on.

**Graduation.** ``window`` consecutive steps active without an attributed anomaly: stable; a
stable optimization is no longer blamed (the seed's rule: monitored for the window after enabling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Anomaly:
    step: int
    kind: str
    value: float
    baseline: float | None = None  # the EMA it was compared with, when there is one


@dataclass(frozen=True)
class Action:
    kind: str  # "disable" | "suspend" | "reenable" | "graduate"
    name: str
    reason: str


@dataclass
class Probation:
    activated: int
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # (step, kind)
    clean: int = 0


@dataclass
class Trial:
    name: str
    kinds: list[str]
    length: int
    off_steps: int = 0
    counted: int = 0  # how many anomalies led to it


class Attribution:
    def __init__(
        self,
        window: int,
        causes: dict[str, frozenset[str]],
        order: tuple[str, ...],
        max_anomalies: int = 3,
    ):
        self.window = int(window)
        self.causes = causes
        self.order = order
        self.max_anomalies = int(max_anomalies)
        self.probation: dict[str, Probation] = {}
        self.trial: Trial | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, name: str, step: int) -> None:
        """``name`` was (re)activated after step ``step``: a fresh safety window."""
        self.probation[name] = Probation(activated=int(step))

    def stop(self, name: str) -> None:
        self.probation.pop(name, None)
        if self.trial is not None and self.trial.name == name:
            self.trial = None

    def in_window(self, name: str) -> bool:
        return name in self.probation

    # -- one processed step -------------------------------------------------------------------------
    def observe(
        self,
        step: int,
        active: tuple[str, ...] | list[str],
        anomalies: list[Anomaly],
        count_clean: bool = True,
    ) -> tuple[list[tuple[str | None, Anomaly]], list[Action]]:
        """Returns (attributions made, for logging: (name or None, anomaly)) and the actions.
        ``count_clean=False`` for a check that is not a step of its own (the throughput check at a
        log interval), so that a step is not counted twice towards graduation."""
        actions: list[Action] = []
        attributions: list[tuple[str | None, Anomaly]] = []
        active = tuple(active)
        self._resolve_trial(step, active, anomalies, actions, count_clean)
        blamed: set[str] = set()
        for a in anomalies:
            suspects = [n for n in active if n in self.probation and a.kind in self.causes.get(n, ())]
            for n in suspects:
                self.probation[n].anomalies.append((step, a.kind))
                attributions.append((n, a))
                blamed.add(n)
            if not suspects:
                attributions.append((None, a))
        for pb in self.probation.values():
            pb.anomalies = [(s, k) for s, k in pb.anomalies if s > step - self.window]
        if self.trial is None:
            self._decide(step, actions)
        for n in active:
            pb = self.probation.get(n)
            if pb is None:
                continue
            if n in blamed:
                pb.clean = 0
                continue
            if not count_clean:
                continue
            pb.clean += 1
            if pb.clean >= self.window:
                actions.append(Action("graduate", n, f"{self.window} clean steps"))
                del self.probation[n]
        return attributions, actions

    def _resolve_trial(self, step, active, anomalies, actions, count_step: bool) -> None:
        t = self.trial
        if t is None or t.name in active:  # steps still launched with it on do not count
            return
        hit = [a for a in anomalies if a.kind in t.kinds]
        if hit:
            self.trial = None
            actions.append(
                Action("reenable", t.name, f"exonerated: {hit[0].kind} at step {step} while it was off")
            )
            return
        if count_step:
            t.off_steps += 1
        if t.off_steps >= t.length:
            self.trial = None
            actions.append(
                Action(
                    "disable",
                    t.name,
                    f"{t.counted} anomalies ({', '.join(t.kinds)}) in its safety window and none in "
                    f"the {t.length} steps after it was switched off",
                )
            )

    def _decide(self, step: int, actions: list[Action]) -> None:
        cands = [n for n, pb in self.probation.items() if len(pb.anomalies) >= self.max_anomalies]
        if not cands:
            return
        rank = {n: i for i, n in enumerate(self.order)}
        chosen = max(cands, key=lambda n: (self.probation[n].activated, -rank.get(n, len(rank))))
        mine = self.probation.pop(chosen).anomalies
        shared = set(mine)
        co = [n for n, pb in self.probation.items() if shared.intersection(pb.anomalies)]
        kinds = sorted({k for _, k in mine})
        summary = ", ".join(f"{k}@{s}" for s, k in mine)
        if not co:
            actions.append(
                Action("disable", chosen, f"{len(mine)} anomalies in its safety window ({summary})")
            )
            return
        for n in co:  # presumed explained by the suspended one until the trial says otherwise
            pb = self.probation[n]
            pb.anomalies = [e for e in pb.anomalies if e not in shared]
        span = mine[-1][0] - mine[0][0] + 1
        length = max(5, min(self.window, 2 * span))
        self.trial = Trial(chosen, kinds, length, counted=len(mine))
        actions.append(
            Action(
                "suspend",
                chosen,
                f"{len(mine)} anomalies ({summary}) shared with {', '.join(co)}: off for up to {length} "
                "steps to see whether they stop",
            )
        )

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "probation": {
                n: {
                    "activated": pb.activated,
                    "anomalies": [list(a) for a in pb.anomalies],
                    "clean": pb.clean,
                }
                for n, pb in self.probation.items()
            },
            "trial": None if self.trial is None else dict(vars(self.trial)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.probation = {
            n: Probation(int(d["activated"]), [(int(s), str(k)) for s, k in d["anomalies"]], int(d["clean"]))
            for n, d in state.get("probation", {}).items()
        }
        t = state.get("trial")
        self.trial = None if t is None else Trial(**t)
