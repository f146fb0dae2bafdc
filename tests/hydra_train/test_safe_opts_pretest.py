"""Pretest arms on the real tiny preset (CPU): verdicts, failures that must fail, and that the
model, optimizer and RNG come back exactly as they were."""

from __future__ import annotations

import time

import pytest
import torch

from hydra_train.callbacks import CallbackList
from hydra_train.config import DeviceInfo, resolve_config
from hydra_train.optim import LRSchedule, build_optimizer
from hydra_train.prefetch import Prefetcher
from hydra_train.run import build_model
from hydra_train.safe_opts.faults import FaultInjector
from hydra_train.safe_opts.pretest import PretestRunner, PretestSettings
from hydra_train.safe_opts.registry import Optimization, build_registry
from hydra_train.safe_opts.standalone import RandomBatches
from hydra_train.safe_opts.toggles import FlashAttention
from hydra_train.trainer import Trainer

from .conftest import TINY_OVERRIDES, VOCAB, tiny_config


def make_trainer(tmp_path, **kw):
    import hydra_kernels

    hydra_kernels.set_use_triton_kernels(False)  # what hydra-train run sets for --triton_kernels off
    cfg = resolve_config(tiny_config(tmp_path, tmp_path / "ck", **kw), DeviceInfo("cpu"))
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB, torch.device("cpu"))
    opt = build_optimizer(model, lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95)).optimizer
    sched = LRSchedule(opt, kind="cosine", max_steps=cfg.max_steps, warmup_steps=cfg.warmup_steps)
    batches = RandomBatches(cfg.batch_size, cfg.seq_len, VOCAB, seed=3)
    tr = Trainer(
        model,
        cfg,
        optimizer=opt,
        schedule=sched,
        loader=Prefetcher(batches, 0),
        val_batches=[],
        device=torch.device("cpu"),
        callbacks=CallbackList(),
    )
    return tr, batches


def runner(tr, batches, reg, log=lambda m: None, **kw):
    settings = PretestSettings(**{"warmup_steps": 1, "steps": 2, **kw.pop("settings", {})})
    return PretestRunner(tr, reg, make_batch=batches, start_index=5, settings=settings, log=log, **kw)


@pytest.fixture(autouse=True)
def _compile_fast(monkeypatch):
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "aot_eager")


def test_passes_and_restores_everything(tmp_path):
    tr, batches = make_trainer(tmp_path, static_routing_mode=True, experimental_prefetch_threads=2)
    # one real step first, so that the optimizer has state to restore
    tr.step_impl([tr.loader.next()])
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    opt_before = [v.clone() for s in tr.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    rng = torch.get_rng_state()
    reg = build_registry(tr.cfg)
    body = runner(tr, batches, reg).run(["static_routing", "prefetch_threads", "fa3"])
    res = body["results"]
    assert {k: r["status"] for k, r in res.items()} == {
        "static_routing": "PASS",
        "prefetch_threads": "PASS",
        "fa3": "N/A",
    }
    assert not res["prefetch_threads"]["timing"]["judged"]  # never on a CPU unless asked
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = [v for s in tr.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(after, opt_before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(o.active for o in reg.values())  # every arm switched back off
    from hydra_train.safe_opts.toggles import routing_wrappers

    assert not any(b.static for b in routing_wrappers(tr.model))  # the safe default: dynamic routing
    assert len(body["default"]["losses"]) == 3 and body["bounds"]["grad_abs"] > 0


def test_injected_nan_fails_that_optimization_only(tmp_path):
    tr, batches = make_trainer(tmp_path, static_routing_mode=True, experimental_prefetch_threads=2)
    inj = FaultInjector.parse("nan_grad:static_routing@pretest")
    res = runner(tr, batches, build_registry(tr.cfg), injector=inj).run(
        ["static_routing", "prefetch_threads"]
    )["results"]
    assert res["static_routing"]["status"] == "FAIL"
    assert res["static_routing"]["reason"] == "non-finite loss or gradients at pretest step 1"
    assert res["prefetch_threads"]["status"] == "PASS"
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_injected_slowness_fails_when_timing_is_judged(tmp_path, clock):
    tr, batches = make_trainer(tmp_path, experimental_prefetch_threads=2)
    inj = FaultInjector.parse("slow=0.4:prefetch_threads@pretest")
    r = runner(tr, batches, build_registry(tr.cfg), injector=inj, settings={"judge_timing": True})
    res = r.run(["prefetch_threads"])["results"]["prefetch_threads"]
    assert res["status"] == "FAIL" and res["reason"].startswith("slower:")
    assert res["timing"]["speedup"] < 0.5
    # a speed FAIL is timed again after its reference arm, and stands only when slow again
    assert res["timed_again"] is True and res["first_timing"]["speedup"] < 0.5
    assert "the first timing: slower:" in res["reason"]


class VirtualClock:
    """Stands in for the pretest's step clock: each reading is 5 ms after the one before, and a
    host stall moves it on without sleeping. Arm timings are then exact on any host, however
    loaded: a CI host running other tests once made a correct arm look slow twice."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.005
        return self.now

    def stall(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    """The virtual clock, read by the pretest's step timing and stalled by injected slowness."""
    import types

    import hydra_train.safe_opts.faults as faults
    import hydra_train.safe_opts.pretest as pretest

    c = VirtualClock()
    monkeypatch.setattr(pretest, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(sleep=c.stall))
    return c


def slow_steps(trainer, clock: VirtualClock, seconds: float):
    """Every step of ``trainer`` stalls the host ``seconds`` first; returns what
    :func:`restore_steps` needs to undo it."""
    inner = trainer.step_impl

    def slow_step(batches):
        clock.stall(seconds)
        return inner(batches)

    trainer.step_impl = slow_step
    return trainer, inner


def restore_steps(wrapped) -> None:
    if wrapped is not None:
        owner, inner = wrapped
        owner.step_impl = inner


class SlowFirstTime(Optimization):
    """Stands in for prefetch_threads: correct, but its first arm's steps each sleep on the host
    (what a drifting host does to one arm and not to the next)."""

    name = "prefetch_threads"

    def __init__(self, cfg, clock: VirtualClock):
        super().__init__(cfg)
        self.clock = clock
        self.runs = 0
        self._wrapped = None

    def requested(self):
        return True

    def activate(self, trainer):
        self.runs += 1
        if self.runs == 1:
            self._wrapped = slow_steps(trainer, self.clock, 1.0)  # 200x a step
        self.active = True

    def deactivate(self, trainer):
        restore_steps(self._wrapped)
        self._wrapped, self.active = None, False


def test_a_speed_fail_that_does_not_come_back_when_timed_again_is_a_pass(tmp_path, clock):
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["prefetch_threads"] = SlowFirstTime(tr.cfg, clock)
    lines: list[str] = []
    # medians of four steps
    r = runner(tr, batches, reg, log=lines.append, settings={"steps": 4, "judge_timing": True})
    res = r.run(["prefetch_threads"])["results"]["prefetch_threads"]
    assert reg["prefetch_threads"].runs == 2  # the arm ran again, after the default arm
    assert res["status"] == "PASS" and res["reason"] is None, res
    assert res["timed_again"] is True and res["first_timing"]["speedup"] < 0.5
    assert res["timing"]["speedup"] > 0.5
    assert any("prefetch_threads: timed again after its reference arm: PASS" in m for m in lines)
    assert [m.split(":")[0] for m in lines if m.startswith("[SafeOpts] pretest arm")] == [
        "[SafeOpts] pretest arm default",
        "[SafeOpts] pretest arm prefetch_threads",
        "[SafeOpts] pretest arm default",
        "[SafeOpts] pretest arm prefetch_threads",
    ]


class NoOpOnTop(Optimization):
    """Stands in for compile: changes nothing, pretested on top of prefetch_threads."""

    name = "compile"
    pretest_on_top_of = ("prefetch_threads",)

    def requested(self):
        return True

    def activate(self, trainer):
        self.active = True

    def deactivate(self, trainer):
        self.active = False


def test_a_stacked_arm_compares_with_its_bases_second_timing(tmp_path, clock):
    """The base's first timing was slow (and ruled out when timed again): the arm stacked on it is
    judged against the second timing, not against the slow one, which would flatter it."""
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["prefetch_threads"] = SlowFirstTime(tr.cfg, clock)
    reg["compile"] = NoOpOnTop(tr.cfg)
    r = runner(tr, batches, reg, settings={"steps": 4, "judge_timing": True})
    res = r.run(["prefetch_threads", "compile"])["results"]
    assert res["prefetch_threads"]["timed_again"] is True
    assert res["prefetch_threads"]["first_timing"]["median_ms"] == pytest.approx(1005.0)  # stalls
    stacked = res["compile"]
    assert stacked["ref"] == "prefetch_threads" and stacked["status"] == "PASS"
    assert "timed_again" not in stacked  # as fast as its base's second timing: no second look
    assert stacked["timing"]["default_median_ms"] == res["prefetch_threads"]["timing"]["median_ms"]
    assert stacked["timing"]["default_median_ms"] == pytest.approx(5.0)


class ScaledWeights(Optimization):
    """A deliberately wrong 'optimization': doubles one weight matrix while active."""

    name = "compile"  # stands in for a registered name so the runner can look it up

    def requested(self):
        return True

    def activate(self, trainer):
        with torch.no_grad():
            trainer.model.embed.weight.mul_(2.0)
        self.active = True

    def deactivate(self, trainer):
        if self.active:
            with torch.no_grad():
                trainer.model.embed.weight.div_(2.0)
        self.active = False


def test_a_wrong_computation_fails_the_gradient_check(tmp_path):
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["compile"] = ScaledWeights(tr.cfg)
    res = runner(tr, batches, reg).run(["compile"])["results"]["compile"]
    assert res["status"] == "FAIL" and res["reason"].startswith("step-0 gradient error")


class Sleepy(ScaledWeights):
    def activate(self, trainer):
        time.sleep(3.0)
        self.active = True

    def deactivate(self, trainer):
        self.active = False


def test_an_arm_over_its_time_limit_fails(tmp_path):
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["compile"] = Sleepy(tr.cfg)
    res = runner(tr, batches, reg, settings={"arm_timeout_s": 0.5}).run(["compile"])["results"]["compile"]
    assert res["status"] == "FAIL" and res["reason"].startswith("did not finish within 0.5 s")


class SwitchStandIn(Optimization):
    """Stands in for a switch such as triton_kernels (N/A on this CPU); ``broken`` makes it raise."""

    def __init__(self, cfg, name, broken=False):
        super().__init__(cfg)
        self.name, self.broken = name, broken

    def requested(self):
        return True

    def activate(self, trainer):
        if self.broken:
            raise RuntimeError(f"no {self.name} today")
        self.active = True

    def deactivate(self, trainer):
        self.active = False


class CompileStandIn(Optimization):
    """Records which switches were on whenever it was switched on."""

    name = "compile"
    pretest_on_top_of = ("triton_kernels", "fa3")

    def __init__(self, cfg, reg):
        super().__init__(cfg)
        self.reg, self.seen = reg, []

    def requested(self):
        return True

    def activate(self, trainer):
        self.seen.append(sorted(n for n in self.pretest_on_top_of if self.reg[n].active))
        self.active = True

    def deactivate(self, trainer):
        self.active = False


def _stacked(tmp_path, broken=()):
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    for name in ("triton_kernels", "fa3"):
        reg[name] = SwitchStandIn(tr.cfg, name, broken=name in broken)
    reg["compile"] = CompileStandIn(tr.cfg, reg)
    return tr, batches, reg


def test_compile_is_pretested_on_top_of_the_switches_that_passed(tmp_path):
    """The compile arm runs after the others, with the switches it traces that passed on, and
    is judged against them together: the code it compiles is what the run, with all of them
    on, reuses. The weights and the RNG come back after the second phase too."""
    tr, batches, reg = _stacked(tmp_path)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    rng = torch.get_rng_state()
    res = runner(tr, batches, reg).run(["compile", "triton_kernels", "fa3"])["results"]
    assert all(torch.equal(v, before[k]) for k, v in tr.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert reg["compile"].seen == [["fa3", "triton_kernels"]]
    assert res["compile"]["status"] == "PASS" and res["compile"]["ref"] == "triton_kernels+fa3"
    assert "triton_kernels+fa3" not in res  # the reference arm is not a result
    assert res["triton_kernels"]["ref"] == res["fa3"]["ref"] == "default"

    reg["compile"].seen.clear()
    res = runner(tr, batches, reg).run(["compile", "triton_kernels"])["results"]
    assert reg["compile"].seen == [["triton_kernels"]] and res["compile"]["ref"] == "triton_kernels"

    reg["compile"].seen.clear()
    res = runner(tr, batches, reg).run(["compile"])["results"]
    assert reg["compile"].seen == [[]] and res["compile"]["ref"] == "default"


def test_a_switch_that_fails_is_left_out_of_the_compile_arm(tmp_path):
    tr, batches, reg = _stacked(tmp_path, broken=("triton_kernels",))
    res = runner(tr, batches, reg).run(["compile", "triton_kernels", "fa3"])["results"]
    assert res["triton_kernels"]["status"] == "FAIL"
    assert "no triton_kernels today" in res["triton_kernels"]["reason"]
    assert reg["compile"].seen == [["fa3"]]
    assert res["compile"]["status"] == "PASS" and res["compile"]["ref"] == "fa3"


class ClashingSwitch(SwitchStandIn):
    """Passes alone, raises when switched on with ``other`` on."""

    def __init__(self, cfg, name, reg, other):
        super().__init__(cfg, name)
        self.reg, self.other = reg, other

    def activate(self, trainer):
        if self.reg[self.other].active:
            raise RuntimeError(f"{self.name} and {self.other} together: no")
        self.active = True


def test_bases_that_fail_together_leave_compile_unpretested(tmp_path):
    tr, batches, reg = _stacked(tmp_path)
    reg["fa3"] = ClashingSwitch(tr.cfg, "fa3", reg, "triton_kernels")
    res = runner(tr, batches, reg).run(["compile", "triton_kernels", "fa3"])["results"]
    assert res["triton_kernels"]["status"] == res["fa3"]["status"] == "PASS"
    assert reg["compile"].seen == []  # not compiled on top of a combination that raised
    assert res["compile"]["status"] == "FAIL"
    assert res["compile"]["reason"].startswith("not pretested: its reference arm (triton_kernels+fa3)")
    assert "fa3 and triton_kernels together: no" in res["compile"]["reason"]


class NormScaled(Optimization):
    """Scales the final norm's weight by 1 + eps while active: a step-0 gradient error ~eps."""

    def __init__(self, cfg, name, eps, on_top=()):
        super().__init__(cfg)
        self.name, self.eps, self.pretest_on_top_of = name, eps, on_top

    def requested(self):
        return True

    def activate(self, trainer):
        with torch.no_grad():
            trainer.model.norm.weight.mul_(1 + self.eps)
        self.active = True

    def deactivate(self, trainer):
        if self.active:
            with torch.no_grad():
                trainer.model.norm.weight.div_(1 + self.eps)
        self.active = False


@pytest.mark.parametrize(("own", "status"), [(1e-6, "PASS"), (5e-6, "FAIL")])
def test_a_stacked_arm_is_bounded_by_its_bases_error(tmp_path, own, status):
    """A base just inside its bound (error ~1e-6 against 1.6e-6 here, fp32) and compile adding as
    much again: the sum is over the safe default's bound but within the one taken from the
    base's error, which compile cannot help carrying; an error of its own five times the base's
    still fails."""
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["triton_kernels"] = NormScaled(tr.cfg, "triton_kernels", 1e-6)
    reg["compile"] = NormScaled(tr.cfg, "compile", own, ("triton_kernels",))
    res = runner(tr, batches, reg).run(["compile", "triton_kernels"])["results"]
    base, comp = res["triton_kernels"], res["compile"]
    assert base["status"] == "PASS"
    assert comp["numerics"]["grad_err"] > base["numerics"]["grad_bound"]  # over the default's bound
    assert comp["numerics"]["grad_bound"] > base["numerics"]["grad_bound"]
    assert comp["status"] == status


def test_tiny_overrides_are_the_real_preset_narrowed():
    assert TINY_OVERRIDES["dim"] == 64  # the tests above use the real tiny preset, only narrower


class PicksAsSDPA(FlashAttention):
    """The real fa3 toggle's verdict logic (``FlashAttention.no_effect``) with a stand-in arm: it
    applies on the CPU, every step sleeps (a host slower during that arm), and ``describe()``
    reports auto's picks as ``same`` says: the kernels plain SDPA runs itself, or not."""

    def __init__(self, cfg, same: bool, clock: VirtualClock):
        super().__init__(cfg)
        self.same, self.clock = same, clock
        self._wrapped = None

    def requested(self):
        return True

    def not_applicable(self, trainer):
        return None

    def activate(self, trainer):
        self._wrapped = slow_steps(trainer, self.clock, 1.0)
        self.active = True

    def deactivate(self, trainer):
        restore_steps(self._wrapped)
        self._wrapped, self.active = None, False

    def describe(self):
        picks = ["sdpa_cudnn"]
        return {"flash_attn_installed": False, "auto_picked": picks, "same_kernels_as_sdpa": self.same}


@pytest.mark.parametrize("same", [True, False])
def test_an_attention_pick_of_sdpas_own_kernels_is_not_judged_on_speed(tmp_path, same, clock):
    """fa3's arm ran the kernels the default arm runs (auto picked plain SDPA's own): its timing
    is the host's noise, so the verdict is N/A with that reason, not a speed FAIL (and no second
    timing); when the picks differ, the same slow arm fails on speed."""
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["fa3"] = PicksAsSDPA(tr.cfg, same, clock)
    res = runner(tr, batches, reg, settings={"judge_timing": True}).run(["fa3"])["results"]["fa3"]
    if same:
        assert res["status"] == "N/A" and "plain SDPA runs itself" in res["reason"], res
        assert "sdpa_cudnn" in res["reason"] and "timed_again" not in res
        assert res["numerics"]  # the gradient check still ran and passed
    else:
        assert res["status"] == "FAIL" and "slower:" in res["reason"], res


def test_fa3_describes_whether_auto_picked_sdpas_own_kernels(tmp_path, monkeypatch):
    """The real fa3 toggle's description, from auto's measurements: the same kernels only when
    every measured shape's pick is plain SDPA's own dispatch."""
    import hydra_model.attention_backend as ab

    fa3 = FlashAttention(tiny_config(tmp_path, tmp_path / "ck"))
    own = {"chosen": "sdpa_cudnn", "sdpa_runs": "cudnn"}
    other = {"chosen": "sdpa_flash", "sdpa_runs": "cudnn"}
    cases = (([own], True), ([own, {"chosen": "sdpa"}], True), ([own, other], False), ([], False))
    for reports, same in cases:
        # measured signatures: (device, dtype, B, Hq, Hkv, S, L, d, causal, grad)
        sigs = {("cuda:0", "bfloat16", 8, 12, 4, 256 * (i + 1), 256 * (i + 1), 64, True, True): r
                for i, r in enumerate(reports)}  # fmt: skip
        monkeypatch.setattr(ab, "_auto_report", sigs)
        got = fa3.describe()
        assert got["same_kernels_as_sdpa"] is same
        assert (fa3.no_effect(got) is not None) is (same and not ab.FLASH_ATTN_AVAILABLE)


def test_an_attention_pick_of_sdpas_own_kernels_still_fails_on_bad_numerics(tmp_path, clock):
    """No effect on speed is no licence for wrong numbers: the same picks with NaN gradients
    injected into the arm fail."""
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["fa3"] = PicksAsSDPA(tr.cfg, True, clock)
    inj = FaultInjector.parse("nan_grad:fa3@pretest")
    res = runner(tr, batches, reg, injector=inj).run(["fa3"])["results"]["fa3"]
    assert res["status"] == "FAIL", res


def test_fa3_with_flash_attn_installed_is_never_without_effect(tmp_path):
    """With flash-attn importable fa3 switches to it, whatever auto measured: never N/A for that."""
    fa3 = FlashAttention(tiny_config(tmp_path, tmp_path / "ck"))
    described = {"same_kernels_as_sdpa": True, "auto_picked": ["sdpa"]}
    assert fa3.no_effect({**described, "flash_attn_installed": False}) is not None
    assert fa3.no_effect({**described, "flash_attn_installed": True}) is None
