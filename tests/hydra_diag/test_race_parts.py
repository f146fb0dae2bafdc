"""The race's parts: the time-based LR schedule against hand computation, the configuration table
and ``--set`` parsing, identical batches for every entrant, the in-place weight restore and the
training-mode evaluation that leaves the model as it was."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from hydra_diag.output import DiagError
from hydra_diag.race.configs import (
    RACE_CONFIGS,
    check_buildable,
    parse_config_names,
    parse_sets,
    resolve_configs,
)
from hydra_diag.race.data import load_race_data
from hydra_diag.race.loop import RaceSettings, evaluate, race_one, restore, snapshot
from hydra_diag.race.schedule import lr_factor
from hydra_diag.synthetic import write_bigram_dataset

GPT_TINY = {"dim": 64, "head_dim": 16, "mlp_hidden": 128, "max_seq_len": 64}
HYDRA_TINY = {"dim": 64, "max_seq_len": 64}


def test_lr_schedule_by_hand():
    # budget 100 s, warmup 5 s, floor 0.1: f = t/5 in warmup, 0.1 + 0.9·½(1 + cos(π(t−5)/95)) after
    f = lambda t: lr_factor(t, 100.0, warmup_frac=0.05, min_ratio=0.1)
    assert f(0) == 0.0
    assert f(2.5) == pytest.approx(0.5)
    assert f(5) == pytest.approx(1.0)
    assert f(5 + 95 / 3) == pytest.approx(0.1 + 0.9 * 0.75)  # cos(π/3) = ½
    assert f(52.5) == pytest.approx(0.55)  # cos(π/2) = 0
    assert f(5 + 2 * 95 / 3) == pytest.approx(0.1 + 0.9 * 0.25)  # cos(2π/3) = −½
    assert f(100) == pytest.approx(0.1) and f(250) == pytest.approx(0.1)
    assert lr_factor(30, 60, warmup_frac=0.0, min_ratio=0.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lr_factor(1, 0)


def test_config_table_and_sets():
    assert set(RACE_CONFIGS) >= {
        "gpt",
        "gpt-ccgqa",
        "hydra",
        "hydra-no-mod",
        "hydra-no-mor",
        "hydra-routing-off",
        "hydra-expert-choice",
    }
    assert parse_config_names(None) == ["gpt", "hydra"]
    assert parse_config_names("all") == list(RACE_CONFIGS)
    sets = parse_sets(
        ["hydra.mod_capacity=0.125", "*.use_chunked_ce=true", "gpt.lr=1.2e-3", "gpt.compile=blocks"]
    )
    assert sets == [
        ("hydra", {"mod_capacity": 0.125}),
        ("*", {"use_chunked_ce": True}),
        ("gpt", {"lr": 1.2e-3}),
        ("gpt", {"compile": "blocks"}),
    ]
    cfgs = resolve_configs(["gpt", "gpt-ccgqa", "hydra"], sets, lr=6e-4, compile_default="model")
    gpt, ccgqa, hydra = cfgs
    assert (gpt.lr, gpt.compile, gpt.overrides) == (1.2e-3, "blocks", {"use_chunked_ce": True})
    assert (ccgqa.lr, ccgqa.compile, ccgqa.overrides) == (
        6e-4,
        "model",
        {"attention": "ccgqa", "use_chunked_ce": True},
    )
    assert (
        hydra.overrides == {"mod_capacity": 0.125, "use_chunked_ce": True} and hydra.routed and not gpt.routed
    )
    off = resolve_configs(["hydra-routing-off"], [], lr=1e-3, compile_default="model")[0]
    assert not off.routed
    # wildcards, and the later of two settings wins
    wild = parse_sets(["hydra*.compile=blocks", "hydra-no-mod.compile=none", "*.dim=96"])
    got = {
        c.name: (c.compile, c.overrides.get("dim"))
        for c in resolve_configs(list(RACE_CONFIGS), wild, lr=1e-3, compile_default="model")
    }
    assert got["gpt"] == got["gpt-ccgqa"] == ("model", 96)
    assert got["hydra"] == got["hydra-expert-choice"] == ("blocks", 96) and got["hydra-no-mod"] == (
        "none",
        96,
    )
    for bad, needle in (
        (["nope.dim=3"], "no configuration 'nope'"),
        (["x*.dim=3"], "no configuration 'x\\*'"),
        (["dim=3"], "CONFIG.FIELD=VALUE"),
        (["hydra.dim"], "CONFIG.FIELD=VALUE"),
    ):
        with pytest.raises(DiagError, match=needle):
            parse_sets(bad)
    with pytest.raises(DiagError, match="learning rate"):
        resolve_configs(["gpt"], [("gpt", {"lr": -1})], lr=1e-3, compile_default="model")
    with pytest.raises(DiagError, match=r"configuration hydra .*bogus"):
        check_buildable(
            resolve_configs(["hydra"], [("hydra", {"bogus": 1})], lr=1e-3, compile_default="model"),
            "tiny",
            {},
        )
    with pytest.raises(DiagError, match="twice"):
        parse_config_names("gpt,gpt")


@pytest.fixture
def bigram(tmp_path):
    folder = write_bigram_dataset(tmp_path / "bigram", 256, 20000, 3000)
    return lambda seed=7: load_race_data(
        str(folder), seq_len=16, batch_size=4, seed=seed, val_windows=8, vocab_size=256
    )


def test_every_entrant_sees_the_same_batches(bigram, monkeypatch):
    from hydra_diag.race.data import RaceData

    seen: dict[str, list[tuple[int, str]]] = {}
    current = {"name": None}
    original = RaceData.batch

    def spy(self, k):
        x, y = original(self, k)
        digest = hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
        seen.setdefault(current["name"], []).append((k, digest))
        return x, y

    monkeypatch.setattr(RaceData, "batch", spy)
    data = bigram()
    settings = RaceSettings(model_size="tiny", budget_s=0.6, evals=1, warmup_steps=1, log_every_s=100)
    cfgs = resolve_configs(
        ["gpt", "hydra"], [("gpt", GPT_TINY), ("hydra", HYDRA_TINY)], lr=1e-3, compile_default="model"
    )
    results = {}
    for cfg in cfgs:
        current["name"] = cfg.name
        results[cfg.name] = race_one(
            cfg, data, settings, torch.device("cpu"), say=str, tick=lambda info: None
        )
    a, b = seen["gpt"], seen["hydra"]
    # one untimed warm-up step on batch 0, then batches 0, 1, 2, ... in order (built by the
    # prefetching worker, at most its buffer of 4 ahead of the last step taken)
    for name, calls in seen.items():
        ks, steps = [k for k, _ in calls], results[name]["steps"]
        assert ks[: 1 + steps] == [0, *range(steps)]
        assert ks[1 + steps :] == list(range(steps, len(ks) - 1)) and len(ks) - 1 - steps <= 4
    n = min(len(a), len(b))
    assert n >= 3 and a[:n] == b[:n]
    # the stream depends on the seed (so the check above can fail), the validation windows do not
    other = bigram(seed=8)
    assert not torch.equal(other.plan.batch(1)[0], data.plan.batch(1)[0])
    assert other.val_ids == data.val_ids and len(data.val_ids) == 8


def test_restore_is_in_place_and_exact():
    from hydra_model.architectures import build_model

    model = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY)
    saved = snapshot(model)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 17))
    model(x[:, :-1], targets=x[:, 1:]).loss.backward()
    opt.step()
    assert any(not torch.equal(v, saved[k]) for k, v in model.named_parameters())
    restore(model, saved)
    for k, v in model.state_dict(keep_vars=True).items():
        assert v.data_ptr() == ptrs[k], k  # the same tensors: compiled code keeps valid references
    for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        assert torch.equal(v, saved[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_training_mode_evaluation_leaves_the_model_unchanged(bigram):
    from hydra_model.architectures import build_model

    data = bigram()
    # loss-free MoE balancing and the routers' statistics move buffers in training-mode forwards
    # (the biases only with gradients on): state to protect
    moe = {"moe_enabled": True, "moe_balancing": "loss_free", "moe_bias_update_rate": 0.1}
    model = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY, **moe).eval()
    batches = data.val_batches()
    probe = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY, **moe).train()
    probe_before = snapshot(probe)
    with torch.no_grad():
        for x, y in batches:
            probe(x, targets=y)
    assert any(not torch.equal(v, probe_before[k]) for k, v in snapshot(probe).items())
    before = snapshot(model)
    loss_train = evaluate(model, batches, torch.device("cpu"), train_mode=True)
    assert not model.training  # mode restored
    for k, v in snapshot(model).items():
        assert torch.equal(v, before[k]), k
    # the mean over batches is per token: recompute it by hand in fp64
    model.train()
    with torch.no_grad():
        tot = sum(float(model(x, targets=y).ce_loss) * y.numel() for x, y in batches)
    assert loss_train == pytest.approx(tot / sum(y.numel() for _, y in batches), rel=1e-5)
    assert math.isfinite(evaluate(model, batches, torch.device("cpu"), train_mode=False))


@pytest.mark.parametrize("scope", ["model", "graphs", "blocks"])
def test_the_race_compiles_with_hydra_trains_inductor_options(monkeypatch, scope):
    """Both entrants compile as hydra-train does (safe_opts/toggles.py's options), graphs as
    mode="reduce-overhead" would, in every scope."""
    from hydra_diag.race.loop import compile_entrant
    from hydra_model.architectures import build_model
    from hydra_train.safe_opts.toggles import INDUCTOR_OPTIONS

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(kw))
    model = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY)
    compile_entrant(model, scope)
    assert calls
    for kw in calls:
        assert "mode" not in kw
        extra = {"triton.cudagraphs": True} if scope == "graphs" else {}
        assert kw["options"] == {**INDUCTOR_OPTIONS, **extra}, kw


@pytest.mark.parametrize("name", ["gpt", "hydra"])
def test_entrants_take_the_chunked_loss_on_cuda_as_hydra_train_does(name):
    """Every entrant's loss is the fused chunked linear + CE on a CUDA device (hydra-train's
    default there), the full-logits loss elsewhere; a ``--set`` of the field wins either way."""
    from hydra_diag.race.loop import build_entrant

    tiny = [f"{name}.{k}={v}" for k, v in (GPT_TINY if name == "gpt" else HYDRA_TINY).items()]
    (cfg,) = resolve_configs([name], parse_sets(tiny), lr=1e-3, compile_default="none")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only the device's type is read
    assert build_entrant(cfg, "tiny", 256, 32, cuda).config.use_chunked_ce is True
    assert build_entrant(cfg, "tiny", 256, 32, cpu).config.use_chunked_ce is False
    assert build_entrant(cfg, "tiny", 256, 32).config.use_chunked_ce is False
    sets = parse_sets([*tiny, f"{name}.use_chunked_ce=false"])
    (off,) = resolve_configs([name], sets, lr=1e-3, compile_default="none")
    assert build_entrant(off, "tiny", 256, 32, cuda).config.use_chunked_ce is False


@pytest.mark.slow
def test_compiled_model_after_restore_matches_a_fresh_model():
    """The setup's compile → warm-up steps → in-place restore, with inductor on the CPU: the compiled
    model then computes what a freshly built model with the same seed computes (about 70 s)."""
    from hydra_diag.race.loop import compile_entrant
    from hydra_model.architectures import build_model

    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY)
    torch.manual_seed(0)
    fresh = build_model("hydra", "tiny", vocab_size=256, **HYDRA_TINY)
    saved = snapshot(model)
    fwd = compile_entrant(model, "model")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        fwd(x[:, :-1], targets=x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = fwd(x[:, :-1], targets=x[:, 1:]).loss.detach()
    restore(model, saved)
    got = fwd(x[:, :-1], targets=x[:, 1:])
    want = fresh(x[:, :-1], targets=x[:, 1:])
    assert not torch.allclose(trained, want.loss.detach(), atol=1e-3)  # the warm-up did train
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.ce_loss.detach(), want.ce_loss.detach(), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_corpus_roots_option(tmp_path):
    from hydra_diag.race.data import corpus_tree_roots
    from hydra_train.pyenv_corpus import environment_roots

    (tmp_path / "extra").mkdir()
    roots = corpus_tree_roots([tmp_path / "extra"])
    assert roots == [("extra", tmp_path / "extra")]
    both = corpus_tree_roots([Path("env"), tmp_path / "extra"])
    assert both == [*environment_roots(), ("extra", tmp_path / "extra")]
    with pytest.raises(DiagError, match="no such folder"):
        corpus_tree_roots([tmp_path / "missing"])


def test_router_thresholds_commit_once_per_optimizer_step(bigram, monkeypatch):
    """HYDRA's causal-routing thresholds move once per optimizer step: the model's default commit
    at the start of each training forward (inside the compiled code on a GPU); evaluations, in
    either routing mode, commit nothing."""
    from hydra_model import CCGQAMoDMoRModel

    calls: list[str] = []
    real = CCGQAMoDMoRModel.commit_router_thresholds

    def spy(self, applied=None):
        calls.append(self.threshold_commit)
        return real(self, applied)

    monkeypatch.setattr(CCGQAMoDMoRModel, "commit_router_thresholds", spy)
    settings = RaceSettings(model_size="tiny", budget_s=0.5, evals=1, warmup_steps=2, log_every_s=100)
    cfg = resolve_configs(["hydra"], [("hydra", HYDRA_TINY)], lr=1e-3, compile_default="model")[0]
    result = race_one(cfg, bigram(), settings, torch.device("cpu"), say=str, tick=lambda info: None)
    assert result["steps"] >= 1
    assert calls == ["forward"] * (settings.warmup_steps + result["steps"])


def test_race_entry_memory_is_read_after_the_warm_up(bigram, monkeypatch):
    """The entry's memory fields are hydra_diag.device_memory's (test_device_memory.py), the peaks
    reset once the warm-up has compiled (and, under the graphs scope, captured) everything and read
    after the last evaluation. Documents written before have ``peak_memory_gib`` instead."""
    from hydra_diag.race import loop

    events: list[str] = []
    figures = {"peak_gib": 8.5, "graph_pool_gib": 7.0, "peak_allocated_gib": 1.2}
    monkeypatch.setattr(loop, "reset_peak_memory", lambda device, **kw: events.append(("reset", kw)))
    monkeypatch.setattr(loop, "peak_memory", lambda device: events.append("read") or figures)
    settings = RaceSettings(model_size="tiny", budget_s=0.3, evals=1, warmup_steps=1, log_every_s=100)
    cfg = resolve_configs(["gpt"], [("gpt", GPT_TINY)], lr=1e-3, compile_default="model")[0]
    result = race_one(cfg, bigram(), settings, torch.device("cpu"), say=events.append, tick=lambda i: None)
    reset = ("reset", {"release_cache": False})  # the clock starts next: the cache stays filled
    assert events.count(reset) == 1
    assert events.index("evaluation warm-up") < events.index(reset) < events.index("evaluating at 0 s")
    assert events[-1] == "read"
    assert {k: result[k] for k in figures} == figures and "peak_memory_gib" not in result
