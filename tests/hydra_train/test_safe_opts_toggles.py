"""The switch-type optimizations really switch, and really switch back."""

from __future__ import annotations

import pytest
import torch

import hydra_kernels
from hydra_kernels import launch_config
from hydra_model import create_ccgqa_mod_mor_model, get_attention_backend
from hydra_train.config import TrainConfig
from hydra_train.prefetch import Prefetcher
from hydra_train.safe_opts.standalone import RandomBatches
from hydra_train.safe_opts.toggles import (
    BLOCK_GRAPHS_LIMIT,
    INDUCTOR_OPTIONS,
    BlackwellTuning,
    CompileModel,
    FlashAttention,
    PrefetchThreads,
    StaticRouting,
    TritonKernels,
    compile_options,
    compile_units,
    routing_wrappers,
    set_static_routing,
)

from .conftest import VOCAB


class FakeTrainer:
    """The trainer attributes the toggles touch."""

    def __init__(self, model, loader=None):
        self.model = self.wrapped = self.forward_model = model
        self.device = torch.device("cpu")
        self.loader = loader
        self.cfg = TrainConfig()


@pytest.fixture
def model():
    hydra_kernels.set_use_triton_kernels(False)
    torch.manual_seed(0)
    return create_ccgqa_mod_mor_model("tiny", dim=64, max_seq_len=64, vocab_size=VOCAB, n_mor_blocks=3)


def loss(m, x):
    """A training-mode loss that leaves the model as it found it (a training forward would move
    the causal routing thresholds, as BatchNorm moves its running statistics)."""
    base = m._orig_mod if hasattr(m, "_orig_mod") else m
    base.threshold_commit = "manual"
    out = m(x, x).loss.detach()
    base.commit_router_thresholds(torch.tensor(False))  # drop the record
    return out


def test_static_routing_is_the_static_model_and_back(model):
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    dynamic = loss(model, x)
    torch.manual_seed(0)
    static_model = create_ccgqa_mod_mor_model(
        "tiny", dim=64, max_seq_len=64, vocab_size=VOCAB, n_mor_blocks=3, static_routing_mode=True
    )
    # a model built static keeps its causal thresholds (for a switch to dynamic): the same keys
    static_model.load_state_dict(model.state_dict())
    opt = StaticRouting(TrainConfig(static_routing_mode=True))
    tr = FakeTrainer(model)
    opt.activate(tr)
    assert torch.equal(loss(model, x), loss(static_model, x))  # same as a model built static
    assert not torch.equal(loss(model, x), dynamic)
    opt.deactivate(tr)
    assert torch.equal(loss(model, x), dynamic) and not any(b.static for b in routing_wrappers(model))


def test_a_model_built_static_switches_to_dynamic_routing_and_back(model):
    """--static_routing_mode builds the model static; when SafeOptimizations turns static routing
    off, that model must route like the dynamic model built with the same weights, not stay soft."""
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    for _ in range(2):  # committed thresholds, so that routing really selects
        model(x, x).loss.backward()
    dynamic = loss(model, x)
    torch.manual_seed(0)
    built_static = create_ccgqa_mod_mor_model(
        "tiny", dim=64, max_seq_len=64, vocab_size=VOCAB, n_mor_blocks=3, static_routing_mode=True
    )
    built_static.load_state_dict(model.state_dict())
    static = loss(built_static, x)
    set_static_routing(built_static, False)
    assert torch.equal(loss(built_static, x), dynamic)
    frac = [float(b.stat_mod[0]) for b in routing_wrappers(built_static) if b.routed]
    assert frac and all(f < 1 for f in frac)  # MoD selects again
    set_static_routing(built_static, True)
    assert torch.equal(loss(built_static, x), static)


def test_prefetch_swaps_the_loader_and_keeps_the_data(model):
    make = RandomBatches(2, 8, VOCAB, seed=1)
    tr = FakeTrainer(model, Prefetcher(make, 3))
    opt = PrefetchThreads(TrainConfig(experimental_prefetch_threads=3, prefetch_buffer_size=4))
    opt.activate(tr)
    assert tr.loader.threads == 3 and tr.loader.position == 3
    x, _ = tr.loader.next()
    opt.deactivate(tr)
    assert tr.loader.threads == 0 and tr.loader.position == 4
    assert torch.equal(x, make(3)[0]) and torch.equal(tr.loader.next()[0], make(4)[0])
    tr.loader.close()


def test_triton_switch(model):
    opt = TritonKernels(TrainConfig(triton_kernels=True))
    tr = FakeTrainer(model)
    opt.activate(tr)
    assert hydra_kernels.use_triton_kernels()
    opt.deactivate(tr)
    assert not hydra_kernels.use_triton_kernels()


def test_gpu_only_switches_are_na_on_cpu_and_still_switch(model):
    tr = FakeTrainer(model)
    fa3 = FlashAttention(TrainConfig())
    assert "CUDA" in fa3.not_applicable(tr)
    fa3.activate(tr)
    assert get_attention_backend() in ("auto", "flash")
    fa3.deactivate(tr)
    assert get_attention_backend() == "sdpa"
    bw = BlackwellTuning(TrainConfig(triton_num_warps=8, triton_block_q=32))
    assert "sm_100" in bw.not_applicable(tr)
    bw.activate(tr)
    assert launch_config.blackwell_tuning_enabled()
    cfg = launch_config.resolve_launch_config(
        "swiglu", torch.device("cpu"), {"default": launch_config.LaunchConfig()}
    )
    assert (cfg.num_warps, cfg.block_q) == (8, 32)
    bw.deactivate(tr)
    assert not launch_config.blackwell_tuning_enabled()
    cfg = launch_config.resolve_launch_config(
        "swiglu", torch.device("cpu"), {"default": launch_config.LaunchConfig()}
    )
    assert cfg == launch_config.LaunchConfig()


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_switches_to_compiled_code_and_back(scope, monkeypatch, request):
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "aot_eager")  # inductor's C++ build is minutes here
    limit = torch._dynamo.config.cache_size_limit  # activation raises it (an alias: not monkeypatchable)
    request.addfinalizer(lambda: setattr(torch._dynamo.config, "cache_size_limit", limit))
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = create_ccgqa_mod_mor_model("tiny", dim=64, max_seq_len=64, vocab_size=VOCAB, n_mor_blocks=1)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
    eager = loss(m, x)
    tr = FakeTrainer(m)
    opt = CompileModel(TrainConfig(compile=True, compile_scope=scope))
    opt.activate(tr)
    if scope == "blocks":
        assert compile_units(m) and all(b._compiled_call_impl is not None for b in compile_units(m))
        assert tr.forward_model is m
    else:
        assert tr.forward_model is not m
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert torch.allclose(loss(tr.forward_model, x), eager, rtol=1e-6)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # it really went through dynamo
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert torch.allclose(loss(tr.forward_model, x), eager, rtol=1e-6)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # the same shapes: no recompile
    if scope == "blocks":  # a static graph per row count and grad mode: room for them all
        assert torch._dynamo.config.cache_size_limit >= BLOCK_GRAPHS_LIMIT
    opt.deactivate(tr)
    assert tr.forward_model is m and all(b._compiled_call_impl is None for b in compile_units(m))
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert torch.equal(loss(m, x), eager) and torch._dynamo.utils.counters["frames"]["ok"] == frames


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_passes_its_inductor_options_to_every_compile(scope, backend, monkeypatch):
    """Each torch.compile the toggle makes gets INDUCTOR_OPTIONS under inductor, none otherwise;
    and torch takes those options (it rejects an unknown key when the compile is set up)."""
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", backend)
    seen = []

    def recording_compile(fn, **kwargs):
        seen.append(kwargs)
        return fn

    m = create_ccgqa_mod_mor_model("tiny", dim=64, max_seq_len=64, vocab_size=VOCAB, n_mor_blocks=2)
    monkeypatch.setattr(torch, "compile", recording_compile)
    opt = CompileModel(TrainConfig(compile=True, compile_scope=scope))
    opt.activate(FakeTrainer(m))
    monkeypatch.undo()
    assert len(seen) == (len(compile_units(m)) if scope == "blocks" else 1)
    want = {"triton.autotune_pointwise": False, "combo_kernels": True} if backend == "inductor" else None
    assert all(kw["backend"] == backend and kw["options"] == want for kw in seen)
    fresh = compile_options("inductor")
    assert fresh == INDUCTOR_OPTIONS and fresh is not INDUCTOR_OPTIONS  # a copy: torch may keep it
    torch.compile(torch.nn.Linear(2, 2), options=compile_options("inductor"))  # accepted: no error
    with pytest.raises(RuntimeError, match="not_an_inductor_option"):
        torch.compile(torch.nn.Linear(2, 2), options={"not_an_inductor_option": 1})  # the check is real


@pytest.mark.parametrize("arch", ["gpt", "hydra"])
def test_compile_under_fsdp_keeps_the_gather_hooks_outside_the_graph(arch, monkeypatch, request, tmp_path):
    """Under FSDP2 a compile unit that is itself sharded (the GPT's layers) has its forward
    compiled, so the unit's gather and reshard hooks run eagerly around it; HYDRA's units sit
    inside the sharded routing wrappers and compile as without FSDP. One process (a world of
    one): the sharded, compiled model gives the unsharded eager model's loss and gradients."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from hydra_model import build_model
    from hydra_train.distributed import DistInfo, wrap_model

    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "aot_eager")
    limit = torch._dynamo.config.cache_size_limit
    request.addfinalizer(lambda: setattr(torch._dynamo.config, "cache_size_limit", limit))
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    request.addfinalizer(dist.destroy_process_group)
    torch.manual_seed(0)
    small = dict(dim=64, max_seq_len=64, vocab_size=VOCAB)
    if arch == "hydra":
        small["n_mor_blocks"] = 2
    else:
        small["n_layers"] = 2
    eager = build_model(arch, "tiny", **small)
    sharded = wrap_model(copy.deepcopy(eager), DistInfo(world_size=1), fsdp=True, device=torch.device("cpu"))
    tr = FakeTrainer(sharded)
    opt = CompileModel(TrainConfig(compile=True, compile_scope="blocks"))
    opt.activate(tr)
    units = compile_units(sharded)
    hooked = [u for u in units if isinstance(u, FSDPModule)]
    assert bool(hooked) == (arch == "gpt")
    assert all("forward" in vars(u) and u._compiled_call_impl is None for u in hooked)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(8))
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    got, want = loss_and_grads(sharded, x), loss_and_grads(eager, x)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # the units went through dynamo
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    opt.deactivate(tr)
    assert all("forward" not in vars(u) and u._compiled_call_impl is None for u in units)


def loss_and_grads(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training loss and every parameter's gradient (whole tensors, also from FSDP2's DTensors),
    the model's gradients and routing thresholds left as they were."""
    base = getattr(m, "_orig_mod", m)
    if hasattr(base, "threshold_commit"):
        base.threshold_commit = "manual"
    out = m(x, x).loss
    out.backward()
    grads = {}
    for name, p in m.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    m.zero_grad(set_to_none=True)
    if hasattr(base, "commit_router_thresholds"):
        base.commit_router_thresholds(torch.tensor(False))
    return out.detach(), grads
