"""Fallbacks that must really happen: a NaN step-0 probe fails its pretest, an activation that
raises halfway leaves nothing on, a partial pretest record is not reused for the rest, and an
isolation trial survives a resume."""

from __future__ import annotations

import dataclasses

import pytest

from hydra_train.run import run_training
from hydra_train.safe_opts.callback import SafeOptimizations
from hydra_train.safe_opts.pretest_log import PretestHook
from hydra_train.safe_opts.registry import Optimization, build_registry
from hydra_train.safe_opts.standalone import run_standalone
from hydra_train.safe_opts.toggles import StaticRouting, routing_wrappers

from .conftest import tiny_config
from .test_safe_opts_pretest import make_trainer, runner


@pytest.fixture(autouse=True)
def _compile_fast(monkeypatch):
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "aot_eager")


class NanFirstForward(Optimization):
    """Stands in for compile: its first forward (the step-0 probe) gives a NaN loss, every later
    one is the default's, so that the arm's steps are all finite."""

    name = "compile"

    def requested(self):
        return True

    def activate(self, trainer):
        inner, calls = trainer.forward_model, []

        def forward(x, y, **kw):
            out = inner(x, y, **kw)
            calls.append(1)
            return dataclasses.replace(out, loss=out.loss * float("nan")) if len(calls) == 1 else out

        trainer.forward_model = forward
        self.active = True

    def deactivate(self, trainer):
        trainer.forward_model = trainer.wrapped
        self.active = False


def test_a_non_finite_step0_probe_fails_the_pretest(tmp_path):
    # NaN errors compared with `>` were False: the probe's NaN passed its gradient and loss checks
    tr, batches = make_trainer(tmp_path)
    reg = build_registry(tr.cfg)
    reg["compile"] = NanFirstForward(tr.cfg)
    res = runner(tr, batches, reg).run(["compile"])["results"]["compile"]
    assert res["status"] == "FAIL", res
    assert res["reason"].startswith("step-0 gradient error nan")


class HalfwayStatic(StaticRouting):
    """Static routing whose activation switches the first routing block, then raises."""

    def activate(self, trainer):
        routing_wrappers(trainer.model)[0].static = True
        raise RuntimeError("second block refused")


def test_an_activation_that_raises_halfway_is_switched_back_off(tmp_path):
    tr, batches = make_trainer(tmp_path, static_routing_mode=True)
    reg = build_registry(tr.cfg)
    reg["static_routing"] = HalfwayStatic(tr.cfg)
    res = runner(tr, batches, reg).run(["static_routing"])["results"]["static_routing"]
    assert res["status"] == "FAIL" and "second block refused" in res["reason"]
    # FAILED, so training runs the safe default: no block may be left routing statically
    assert not any(b.static for b in routing_wrappers(tr.model))


def test_a_partial_pretest_record_is_not_reused_for_the_rest(bin_dataset, tmp_path):
    """``hydra-train pretest --only static_routing`` in the run's folder records the run's
    fingerprint with one result: the run must pretest prefetch_threads, not call it FAILED
    ("no pretest result") for good."""
    cfg = tiny_config(
        bin_dataset,
        tmp_path / "ck",
        max_steps=2,
        save_every=100,
        static_routing_mode=True,
        experimental_prefetch_threads=2,
    )
    part = run_standalone(cfg, only=["static_routing"], log=lambda m: None)
    assert set(part["results"]) == {"static_routing"}
    log: list[str] = []
    s = run_training(cfg, callbacks=[SafeOptimizations(cfg, log=log.append)])
    assert s["safe_opts"]["prefetch_threads"] == "ENABLED", s["safe_opts_reasons"]
    assert any("lacks prefetch_threads" in m for m in log), log
    hist = PretestHook(tmp_path / "ck" / "pretest_logs").get_history()
    assert len(hist) == 2 and set(hist[-1]["results"]) == {"static_routing", "prefetch_threads"}
    # a record with every result is reused as before
    hook = PretestHook(tmp_path / "ck" / "pretest_logs")
    fp = hist[-1]["fingerprint"]
    assert hook.decide(fp, "tiny", None, needed=["static_routing", "prefetch_threads"])[1] is not None


def test_a_run_resumed_during_an_isolation_trial_finishes_the_trial(tmp_path):
    """Saved while static routing was suspended for its trial: after the resume the trial goes
    on and decides (here: no anomaly while it is off, so DISABLED), instead of being dropped and
    leaving it SUSPENDED for the rest of the run."""
    tr, _ = make_trainer(
        tmp_path, static_routing_mode=True, experimental_prefetch_threads=2, experimental_skip_pretest=True
    )
    safe = SafeOptimizations(tr.cfg, log_dir=tmp_path / "logs", log=lambda m: None)
    trial = {"name": "static_routing", "kinds": ["nan_grad"], "length": 5, "off_steps": 1, "counted": 3}
    safe.load_state_dict(
        {
            "status": {"static_routing": "SUSPENDED", "prefetch_threads": "ENABLED"},
            "reasons": {"static_routing": "3 anomalies shared with prefetch_threads: off for up to 5 steps"},
            "attribution": {
                "probation": {"prefetch_threads": {"activated": 0, "anomalies": [], "clean": 2}},
                "trial": trial,
            },
        }
    )
    safe.apply(tr)
    assert safe.attribution.trial is not None and safe.attribution.trial.name == "static_routing"
    for step in range(1, 6):
        safe._observe(step, safe.active_names(), [], True)
    assert safe.status["static_routing"] == "DISABLED"
    assert "none in the 5 steps after it was switched off" in safe.reasons["static_routing"]


def test_only_names_an_optimization_that_is_not_requested(tmp_path):
    """``hydra-train pretest --only fp8`` without ``--experimental_fp8`` pretests nothing: it must
    say why instead of printing an empty table."""
    from hydra_train.config import TrainConfig

    from .conftest import TINY_OVERRIDES

    cfg = TrainConfig(
        model_size="tiny",
        device="cpu",
        batch_size=2,
        seq_len=16,
        vocab_size=200,
        cpu_threads=1,
        model_overrides=dict(TINY_OVERRIDES),
        checkpoint_dir=str(tmp_path),
    )
    lines: list[str] = []
    rec = run_standalone(cfg, only=["fp8"], log=lines.append)
    assert rec["results"] == {}
    assert "[SafeOpts] fp8: not requested, not pretested (add --experimental_fp8 or --all)" in lines


class NotWithTheOthers(Optimization):
    """Stands in for cuda_graphs next to 8-bit Adam: applicable when classified, N/A once the
    optimizations activated before it are on."""

    name = "cuda_graphs"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.asked = 0

    def requested(self):
        return True

    def not_applicable(self, trainer):
        self.asked += 1
        return None if self.asked == 1 else "needs torch's fused AdamW (stand-in)"

    def activate(self, trainer):
        self.active = True

    def deactivate(self, trainer):
        self.active = False


def test_an_optimization_found_not_applicable_at_activation_is_logged_with_its_reason(tmp_path):
    tr, _ = make_trainer(tmp_path, experimental_skip_pretest=True)
    log: list[str] = []
    safe = SafeOptimizations(tr.cfg, log_dir=tmp_path / "logs", log=log.append)
    safe.registry["cuda_graphs"] = NotWithTheOthers(tr.cfg)
    safe.status["cuda_graphs"] = "PENDING"
    safe.apply(tr)
    assert safe.status["cuda_graphs"] == "N/A" and not safe.registry["cuda_graphs"].active
    events = PretestHook(tmp_path / "logs").events()
    assert [(e["event"], e["reason"]) for e in events if e.get("name") == "cuda_graphs"] == [
        ("not_applicable", "needs torch's fused AdamW (stand-in)")
    ]
    assert any("cuda_graphs" in m and "needs torch's fused AdamW (stand-in)" in m for m in log), log
