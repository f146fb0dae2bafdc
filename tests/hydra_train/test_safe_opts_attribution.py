"""Attribution: blame rule, capability filter, window expiry, graduation, isolation trials."""

from __future__ import annotations

from hydra_train.safe_opts.attribution import Anomaly, Attribution
from hydra_train.safe_opts.registry import ANOMALY_KINDS, NAMES, NAN_GRAD, THROUGHPUT_DROP

ALL = frozenset(ANOMALY_KINDS)
CAUSES = {n: ALL for n in NAMES} | {"prefetch_threads": frozenset({THROUGHPUT_DROP})}


def make(window=10):
    return Attribution(window, CAUSES, NAMES)


def run(att, steps, active, fault):
    """Feed steps; ``fault(step, active)`` -> anomaly kind or None. Returns all actions."""
    actions = []
    for s in steps:
        kind = fault(s, active)
        anomalies = [Anomaly(s, kind, float("nan"))] if kind else []
        _, acts = att.observe(s, tuple(active), anomalies)
        for a in acts:
            actions.append((s, a.kind, a.name))
            if a.kind in ("disable", "suspend"):
                active.discard(a.name)
            elif a.kind == "reenable":
                active.add(a.name)
                att.start(a.name, s)
    return actions


def test_single_suspect_disabled_on_third_anomaly():
    att = make()
    att.start("compile", 0)
    acts = run(att, range(1, 10), {"compile"}, lambda s, a: NAN_GRAD if s in (3, 5, 6) else None)
    assert acts == [(6, "disable", "compile")]


def test_capability_filter_and_unattributed_anomalies():
    att = make()
    att.start("prefetch_threads", 0)
    attributions, actions = att.observe(1, ("prefetch_threads",), [Anomaly(1, NAN_GRAD, float("nan"))])
    assert attributions[0][0] is None and not actions  # prefetching cannot make NaN gradients
    attributions, _ = att.observe(2, ("prefetch_threads",), [Anomaly(2, THROUGHPUT_DROP, 3.0)])
    assert attributions[0][0] == "prefetch_threads"


def test_old_anomalies_leave_the_window():
    att = make(window=10)
    att.start("fa3", 0)
    # anomalies 12 steps apart never gather 3 inside one 10-step window
    acts = run(att, range(1, 40), {"fa3"}, lambda s, a: NAN_GRAD if s in (2, 14, 26, 38) else None)
    assert not [a for a in acts if a[1] == "disable"]


def test_graduation_after_window_clean_steps_and_no_blame_afterwards():
    att = make(window=5)
    att.start("fa3", 0)
    acts = run(att, range(1, 6), {"fa3"}, lambda s, a: None)
    assert acts == [(5, "graduate", "fa3")] and not att.in_window("fa3")
    acts = run(att, range(6, 12), {"fa3"}, lambda s, a: NAN_GRAD)
    assert acts == []  # stable: anomalies are no longer blamed on it


def test_anomaly_resets_the_clean_count():
    att = make(window=5)
    att.start("fa3", 0)
    acts = run(att, range(1, 9), {"fa3"}, lambda s, a: NAN_GRAD if s == 3 else None)
    assert acts == [(8, "graduate", "fa3")]  # five clean steps after the one at step 3


def test_isolation_convicts_the_culprit_and_exonerates_the_innocent():
    # both active from step 0, fault follows static_routing; compile ranks higher by risk, so it
    # is suspended first, exonerated when the fault goes on, and static_routing ends disabled
    att = make(window=50)
    for n in ("compile", "static_routing"):
        att.start(n, 0)
    active = {"compile", "static_routing"}
    acts = run(att, range(1, 40), active, lambda s, a: NAN_GRAD if s >= 5 and "static_routing" in a else None)
    kinds = [(k, n) for _, k, n in acts]
    assert kinds[:2] == [("suspend", "compile"), ("reenable", "compile")]
    assert ("disable", "static_routing") in kinds and ("disable", "compile") not in kinds
    assert active == {"compile"}


def test_isolation_when_the_first_suspect_is_guilty():
    att = make(window=50)
    for n in ("compile", "static_routing"):
        att.start(n, 0)
    active = {"compile", "static_routing"}
    acts = run(att, range(1, 30), active, lambda s, a: NAN_GRAD if s >= 5 and "compile" in a else None)
    assert [(k, n) for _, k, n in acts] == [("suspend", "compile"), ("disable", "compile")]
    suspend_step, disable_step = acts[0][0], acts[1][0]
    assert disable_step - suspend_step == 6  # trial = 2 × span of its 3 anomalies (5..7)
    assert active == {"static_routing"}


def test_most_recent_activation_is_suspected_first():
    att = make(window=50)
    att.start("compile", 0)
    att.start("prefetch_threads", 3)  # later, lower risk: still first in line
    active = {"compile", "prefetch_threads"}
    acts = run(att, range(4, 8), active, lambda s, a: THROUGHPUT_DROP if s >= 5 else None)
    assert acts[0][1:] == ("suspend", "prefetch_threads")


def test_state_round_trip_mid_trial():
    att = make(window=50)
    for n in ("compile", "static_routing"):
        att.start(n, 0)
    run(att, range(1, 8), {"compile", "static_routing"}, lambda s, a: NAN_GRAD if s >= 5 else None)
    assert att.trial is not None
    other = make(window=50)
    other.load_state_dict(att.state_dict())
    assert other.state_dict() == att.state_dict()
    assert other.trial.name == att.trial.name and other.probation.keys() == att.probation.keys()
