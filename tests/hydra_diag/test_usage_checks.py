"""Values wrong by themselves are refused before any work, as one line (or click's usage box) with
exit 2; a sweep where every run failed exits 1. Found by a new user's probe: each of these used to
train first, print a traceback, or exit 0."""

from __future__ import annotations

import pytest

from .conftest import invoke, run_json


def usage_error(res, *needles: str) -> str:
    """Exit 2 with every needle in stderr (one ``error:`` line, or click's box); stderr's text."""
    assert res.exit_code == 2, res.output
    text = " ".join(res.stderr.replace("│", " ").split())
    for n in needles:
        assert n in text, text
    assert "Traceback" not in res.output
    return text


@pytest.fixture
def no_training(monkeypatch):
    """Record the short runs a command would start, and start none."""
    from hydra_diag import short_runs

    calls: list[dict] = []

    def fake(**kw):
        calls.append(kw)
        raise AssertionError("a run started before the values were checked")

    monkeypatch.setattr(short_runs, "run_short_training", fake)
    return calls


KNOBS = ["sweep", "knobs", "--device", "cpu", "--steps", 2, "--no_plot"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--knob", "lr=abc"], "--knob lr: 'abc' is not a number"),
        (["--knob", "mod_capacity=abc"], "--knob mod_capacity: 'abc' is not a number"),
        (["--knob", "lr=-1"], "--lr must be > 0"),
        (["--knob", "lr=0"], "--lr must be > 0"),
        (["--knob", "warmup_steps=1.5"], "not a whole number"),
        (["--knob", "mod_capacity=1.5"], "mod_capacity"),
        (["--model_size", "huge"], "'huge' is not a preset"),
        (["--knob", "learning_speed=1,2"], "learning_speed"),
    ],
)
def test_sweep_knobs_checks_every_value_before_the_first_run(runner, no_training, args, needle):
    # lr=abc was a TypeError traceback from hydra-train; lr=-1, mod_capacity=1.5 and an unknown
    # preset a failed row per run after the others had trained, and exit 0
    usage_error(invoke(runner, [*KNOBS, *args]), needle)
    assert no_training == []


def test_sweep_knobs_on_a_named_corpus_checks_its_vocabulary_first(runner, no_training):
    # the corpus's BPE needs at least 300 ids: checked against stdlib, not the synthetic stream
    usage_error(invoke(runner, [*KNOBS, "--dataset", "stdlib", "--knob", "vocab_size=100,4096"]), "300")
    assert no_training == []


def test_sweep_knobs_exits_1_when_no_run_finished(runner, monkeypatch):
    from hydra_diag import short_runs
    from hydra_diag.output import DiagError

    def refused(**kw):
        raise DiagError(f"{kw['label']}: out of memory")

    monkeypatch.setattr(short_runs, "run_short_training", refused)
    out = run_json(runner, [*KNOBS, "--knob", "lr=0.001"], code=1)
    assert out["best"] is None and all(r["error"] for r in out["runs"])


SCALING = ["analyze", "scaling", "--device", "cpu", "--steps", 2, "--no_plot"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--target_params", -1], "--target-params"),  # math domain error after all the training
        (["--target_params", 0], "--target-params"),
        (["--vocab_size", -7], "--vocab-size"),  # ValueError traceback from the synthetic data
        (["--vocab_size", 0], "--vocab-size"),  # silently 512
        (["--variant", "tiny:dim=abc", "--variant", "tiny"], "dim: 'abc' is not a number"),
        (["--variant", "huge", "--variant", "tiny"], "'huge' is not a preset"),
        (["--level", 90], "--level"),
        (["--uncertainty", "jackknife"], "--uncertainty"),
    ],
)
def test_analyze_scaling_checks_before_training(runner, no_training, args, needle):
    usage_error(invoke(runner, [*SCALING, *args]), needle)
    assert no_training == []


LEARNING = ["analyze", "learning", "--checkpoint_dir", "RUN", "--no_plot"]
WATCHDOG = ["moe", "watchdog", "--checkpoint_dir", "RUN", "--once", "--no_plot"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*LEARNING, "--spike_factor", -1], "--spike-factor"),
        ([*LEARNING, "--spike_factor", 0], "--spike-factor"),
        ([*LEARNING, "--spike_factor", "nan"], "--spike-factor"),
        ([*LEARNING, "--plateau_frac", 0], "--plateau-frac"),
        ([*LEARNING, "--plateau_frac", 5], "--plateau-frac"),
        ([*LEARNING, "--plateau_tol", -1], "--plateau-tol"),
        ([*WATCHDOG, "--dead_share", -1], "--dead-share"),
        ([*WATCHDOG, "--collapse_share", 0], "--collapse-share"),
        ([*WATCHDOG, "--collapse_share", 5], "--collapse-share"),
        (["analyze", "deep-diagnosis", "--explode_ratio", -1], "--explode-ratio"),
        (["analyze", "deep-diagnosis", "--dead_ratio", -5], "--dead-ratio"),
        (["health", "model", "--loss_tolerance", -1], "--loss-tolerance"),
        (["eval", "sanity", "--overfit_ratio", -1], "--overfit-ratio"),
    ],
)
def test_impossible_thresholds_are_usage_errors(runner, tmp_path, args, needle):
    # each was accepted: the run's database analysed with it (exit 0), or a model checked against
    # a threshold no value can meet
    from .test_watchdog import _collapsing_run

    run = _collapsing_run(tmp_path / "run") if "RUN" in args else None
    usage_error(invoke(runner, [run if a == "RUN" else a for a in args]), needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dashboard", "--port", -1], "--port"),
        (["dashboard", "--port", 70000], "--port"),
        (["health", "model", "--device", "tpu"], "--device"),
        (["eval", "checkpoint", "--checkpoint", "x.pt", "--split", "bogus"], "--split"),
        (["health", "model", "--set", "dim=-5"], "dim=-5"),
        (["health", "model", "--set", "garbage"], "--set 'garbage'"),
        (["health", "model", "--model_size", "huge"], "huge"),
        (["race", "run", "--set", "garbage"], "--set 'garbage'"),
    ],
)
def test_values_wrong_by_themselves_exit_2(runner, args, needle):
    usage_error(invoke(runner, args), needle)


@pytest.fixture
def no_corpus(monkeypatch):
    """Record the corpus loads of `race run`, and load none (the pyenv corpus takes minutes)."""
    from hydra_diag.race import data

    calls: list[str] = []

    def fake(dataset, **kw):
        calls.append(dataset)
        raise AssertionError("the corpus was read before the flags were checked")

    monkeypatch.setattr(data, "load_race_data", fake)
    return calls


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model_size", "huge"], "unknown model_size 'huge'"),
        (["--set", "gpt.nosuchfield=3"], "nosuchfield"),
        (["--set", "gpt.dim=-5"], "configuration gpt"),
        (["--vocab_size", 100], "--vocab-size 100 is too small"),
    ],
)
def test_race_run_checks_the_flags_before_the_corpus(runner, no_corpus, args, needle):
    res = invoke(runner, ["race", "run", "--configs", "gpt", "--budget", 1, "--device", "cpu", *args])
    usage_error(res, needle)
    assert no_corpus == []


@pytest.mark.parametrize("tokenizer", ["nope.json", "text.txt"])
def test_eval_checkpoint_refuses_a_tokenizer_as_convert_does(runner, tmp_path, tokenizer):
    # it was read only for text data: with the run's shards a missing file went unnoticed, exit 0
    (tmp_path / "text.txt").write_text("not a tokenizer\n")
    res = invoke(
        runner,
        ["eval", "checkpoint", "--checkpoint", tmp_path / "ck.pt", "--tokenizer", tmp_path / tokenizer],
    )
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "tokenizer file" in lines[-1] and tokenizer in lines[-1], res.stderr


def test_bench_inference_without_cuda_suggests_the_cpu(runner, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = invoke(runner, ["bench", "inference"])
    assert res.exit_code == 1 and "--device cpu" in res.stderr, res.output
