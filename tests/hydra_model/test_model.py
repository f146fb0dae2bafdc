"""The full model: losses, gradients for every parameter, eval causality in every mode,
torch.compile(fullgraph=True), the Triton kernels under the interpreter, statistics."""

from __future__ import annotations

import math

import pytest
import torch

import hydra_kernels
from hydra_model import create_ccgqa_mod_mor_model, routing_stats_to_python

from .conftest import MODES, random_tokens, small_model


@pytest.mark.parametrize("mode", list(MODES))
def test_every_parameter_gets_a_finite_nonzero_gradient(mode):
    model = small_model(**MODES[mode]).train()
    out = model(random_tokens(2, 17), targets=random_tokens(2, 17, seed=3))
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_routers_learn_from_the_lm_loss_alone():
    zero = dict(mod_aux_weight=0.0, mor_aux_weight=0.0, router_z_weight=0.0, moe_aux_weight=0.0)
    model = small_model(moe_enabled=True, **zero).train()
    out = model(random_tokens(2, 17), targets=random_tokens(2, 17, seed=3))
    torch.testing.assert_close(out.loss, out.ce_loss)
    out.loss.backward()
    routers = [(n, p) for n, p in model.named_parameters() if "router" in n]
    assert len(routers) >= 7  # MoD (middle block), MoR (3 blocks), MoE (3 blocks)
    for name, p in routers:
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("mode", list(MODES))
def test_eval_is_causal(mode):
    """Logits at t must not depend on tokens after t. Routing must really be mixed for this to
    mean anything, so that is checked too."""
    model = small_model(**MODES[mode]).eval()
    x = random_tokens(2, 23)
    with torch.no_grad():
        ref = model(x).logits
        stats = routing_stats_to_python(model.routing_stats())
        for t in (0, 7, 15, 22):
            x2 = x.clone()
            x2[:, t + 1 :] = random_tokens(2, 22 - t, seed=100 + t)
            got = model(x2).logits
            # the per-expert MoE loop batches rows differently when other tokens change: ≤ 1e-5
            torch.testing.assert_close(got[:, : t + 1], ref[:, : t + 1], atol=1e-5, rtol=0)
    if mode not in ("static", "routing_off"):
        assert 0 < stats["mod"][0]["selected_frac"] < 1
    if mode in ("dynamic", "moe", "moe_loss_free", "token_choice"):
        assert any(0 < s["avg_depth"] - 1 < 2 for s in stats["mor"])


def test_expert_choice_training_is_not_causal():
    """A sanity check that the causality test can fail: top-k over the sequence sees the future."""
    model = small_model(mod_capacity=0.3, routing="expert_choice").train()
    x = random_tokens(1, 23)
    x2 = x.clone()
    x2[:, 12:] = random_tokens(1, 11, seed=9)
    with torch.no_grad():
        diff = (model(x).logits[:, :12] - model(x2).logits[:, :12]).abs().max()
    assert diff > 1e-4


def test_initial_loss_is_near_log_vocab():
    torch.manual_seed(0)
    model = create_ccgqa_mod_mor_model("tiny", vocab_size=500, max_seq_len=64)
    out = model(random_tokens(4, 32, vocab=500), targets=random_tokens(4, 32, vocab=500, seed=5))
    assert abs(out.ce_loss.item() - math.log(500)) < 0.25


def test_chunked_ce_gives_the_same_loss_without_logits():
    model = small_model()
    chunked = small_model(use_chunked_ce=True)
    chunked.load_state_dict(model.state_dict())
    x, y = random_tokens(2, 13), random_tokens(2, 13, seed=4)
    y[0, :3] = -100
    a, b = model(x, targets=y), chunked(x, targets=y)
    assert b.logits is None and a.logits.shape == (2, 13, 97)
    torch.testing.assert_close(b.ce_loss, a.ce_loss, atol=1e-5, rtol=1e-5)
    ref = torch.nn.functional.cross_entropy(a.logits.reshape(-1, 97), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(a.ce_loss, ref)


def test_routing_stats_are_detached_tensors_and_convert():
    model = small_model(moe_enabled=True).train()
    model(random_tokens(2, 11), targets=random_tokens(2, 11))
    stats = model.routing_stats()
    assert [s["layer"] for s in stats["mod"]] == [1]
    assert [s["layer"] for s in stats["mor"]] == [0, 1, 2] == [s["layer"] for s in stats["moe"]]
    for group in stats.values():
        for entry in group:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert not value.requires_grad, key
    py = routing_stats_to_python(stats)
    assert 0 < py["mod"][0]["selected_frac"] <= math.ceil(0.75 * 11) / 11  # within the budget
    assert len(py["mor"][0]["depth_hist"]) == 4
    assert sum(py["moe"][0]["utilization"]) == pytest.approx(1.0)


def test_routing_off_has_no_routers_and_plain_attention():
    model = small_model(routing_off=True)
    names = [n for n, _ in model.named_parameters()]
    assert not any("router" in n or "conv" in n or "temperature" in n for n in names)
    assert model.routing_stats() == {"mod": [], "mor": [], "moe": []}


def test_bad_calls_are_refused():
    model = small_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(random_tokens(1, 65))
    from hydra_model import ModelCache

    with pytest.raises(RuntimeError, match="eval"):
        model.train()(random_tokens(1, 3), cache=ModelCache(capacity=8))


@pytest.mark.parametrize("recursions", [2, 1])
def test_compiles_fullgraph_without_graph_breaks(recursions):
    """Dynamic routing in training (top-k, gather/scatter, statistics buffers) traces as one graph
    and matches eager in loss and gradients (MoD + MoR, and MoD alone as in the 100M preset)."""
    model = small_model(n_mor_blocks=1, recursions_per_block=recursions, mod_dense_first_last=False).train()
    x, y = random_tokens(2, 12), random_tokens(2, 12, seed=2)
    model.threshold_commit = "manual"  # no commits: both forwards route with the same thresholds
    eager = model(x, targets=y)
    frac = routing_stats_to_python(model.routing_stats())["mod"][0]["selected_frac"]
    eager.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x, targets=y)
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)
    assert routing_stats_to_python(model.routing_stats())["mod"][0]["selected_frac"] == pytest.approx(frac)
    assert 0 < frac <= 0.75


@pytest.mark.parametrize("restricted_sdpa", [False, True])
def test_compiled_training_and_evaluation_graphs_are_ones_torch_can_cache(restricted_sdpa, monkeypatch):
    """torch's own check (the one AOTAutograd runs before caching a compiled graph) finds nothing
    in HYDRA's traced graphs, training under autocast and evaluation: an autocast context or an
    autograd.Function in the graph made every warm compile trace the joint graph again. With
    SDPA restricted to one kernel the ``sdpa_kernel`` context is traced too (compile_cache.py)."""
    from hydra_model.options import OPTIONS

    cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    monkeypatch.setattr(OPTIONS, "sdpa_flash_only", restricted_sdpa)
    reasons: list[str] = []
    targets: set = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        try:
            cache.check_cacheable(gm)
        except cache.BypassAOTAutogradCache as exc:
            reasons.append(str(exc).split("\n")[0])
        return gm.forward

    model = small_model(n_mor_blocks=2, recursions_per_block=2).train()
    x, y = random_tokens(2, 16), random_tokens(2, 16, seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, targets=y)
    out.loss.backward()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x, targets=y)
    assert reasons == []
    assert "hydra_model.gather_rows.default" in targets  # the routed gather was in the graph
    assert any("_sdpa_kernel" in t for t in targets) == restricted_sdpa


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code needs a CUDA device")
def test_inductor_compiled_training_matches_eager_on_cuda():
    """What a compiled training run executes (inductor code; the routed gather a custom op there)
    against the eager model in fp32: the same loss, and the gradient of all parameters together
    within 1e-5 of eager's norm (the pretest's measure; reductions run in another order)."""
    model = small_model(n_mor_blocks=2, recursions_per_block=2).cuda().train()
    model.threshold_commit = "manual"  # both forwards route with the same thresholds
    x, y = random_tokens(2, 64).cuda(), random_tokens(2, 64, seed=4).cuda()
    eager = model(x, targets=y)
    eager.loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    out = torch.compile(model)(x, targets=y)
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-6)
    diff = torch.cat([(p.grad - r).flatten() for p, r in zip(model.parameters(), ref, strict=True)])
    assert float(diff.norm()) <= 1e-5 * float(torch.cat([r.flatten() for r in ref]).norm())


@pytest.mark.skipif(
    not hydra_kernels.controls.device_supports_triton(torch.device("cpu")), reason="needs TRITON_INTERPRET=1"
)
def test_a_no_grad_forward_with_the_kernels_on_compiles_fullgraph():
    """The no-grad forward's kernels (a routed block's glue, CCGQA's copies, a prefill's cache)
    are raw Triton launches: inside torch.compile the references run, so an evaluation forward
    traces as one graph with hydra_kernels' Triton path on, and its logits match eager's."""
    hydra_kernels.set_use_triton_kernels(True)
    model = small_model(n_mor_blocks=1, mod_dense_first_last=False).eval()
    x = random_tokens(2, 12)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x).logits
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x).logits
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_triton_kernels_under_the_interpreter_match_the_references():
    """One tiny forward+backward with the hydra_kernels Triton paths on (interpreted on CPU)."""
    cfg = dict(
        vocab_size=37,
        dim=32,
        n_mor_blocks=1,
        recursions_per_block=2,
        n_heads=2,
        n_kv_heads=1,
        compression_factor=1.0,
        mlp_ratio=1.5,
        mlp_multiple_of=8,
        mod_dense_first_last=False,
        max_seq_len=16,
        use_chunked_ce=True,
    )
    torch.manual_seed(0)
    model = create_ccgqa_mod_mor_model("tiny", **cfg).train()
    x, y = random_tokens(1, 6, vocab=37), random_tokens(1, 6, vocab=37, seed=3)
    runs = {}
    model.threshold_commit = "manual"  # no commits: both runs route with the same thresholds
    for use_triton in (False, True):
        hydra_kernels.set_use_triton_kernels(use_triton)
        hydra_kernels.reset_fallback_counts()
        model.zero_grad()
        out = model(x, targets=y)
        out.loss.backward()
        runs[use_triton] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if use_triton:
            assert sum(hydra_kernels.fallback_counts().values()) == 0, hydra_kernels.fallback_counts()
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-4, rtol=1e-4)
    for n, g in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][n], g, atol=1e-4, rtol=1e-3, msg=n)


def test_model_moves_and_casts_like_any_module():
    model = small_model(moe_enabled=True).to("cpu").double()
    assert model.embed.weight.dtype == torch.float64
    assert model.rope.cos.dtype == torch.float32  # the rotary table stays fp32
    out = model(random_tokens(1, 5), targets=random_tokens(1, 5))
    assert out.logits.dtype == torch.float64 and torch.isfinite(out.loss)
