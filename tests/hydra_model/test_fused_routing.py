"""The fused routing glue against op-by-op fp64 references, and traceable by torch.compile with
dynamic shapes and no graph break (what runs on CUDA; aot_eager here, so no code generation)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hydra_model.fused_routing as fr


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)


@pytest.mark.parametrize("impl", ["fused", "eager", "traced"])
def test_router_logits_equal_a_linear_router_on_the_rms_normalised_stream(impl):
    g = _gen(5)
    h = torch.randn(2, 9, 23, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(23, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn((), generator=g, dtype=torch.float64, requires_grad=True)
    fn = {
        "fused": fr._router_logits,
        "eager": fr._router_logits_eager,
        "traced": _compiled(fr._router_logits),
    }
    logit, bce_logit = fn[impl](h, w, b, 1e-6, True)
    hr, wr, br = (t.detach().clone().requires_grad_() for t in (h, w, b))
    ref = F.rms_norm(hr, (23,), eps=1e-6) @ wr + br
    torch.testing.assert_close(logit, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(bce_logit, logit)
    g1, g2 = (
        torch.randn(2, 9, generator=g, dtype=torch.float64),
        torch.randn(2, 9, generator=g, dtype=torch.float64),
    )
    ((logit * g1).sum() + (bce_logit * g2).sum()).backward()
    (ref * g1).sum().backward()  # h learns only from the gate logit ...
    torch.testing.assert_close(h.grad, hr.grad, atol=1e-10, rtol=1e-10)
    wd, bd = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref2 = F.rms_norm(h.detach(), (23,), eps=1e-6) @ wd + bd
    (ref2 * (g1 + g2)).sum().backward()  # ... the router from both
    torch.testing.assert_close(w.grad, wd.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(b.grad, bd.grad, atol=1e-10, rtol=1e-10)
    assert fn[impl](h, w, b, 1e-6, False)[1] is None


@pytest.mark.parametrize("traced", [False, True])
def test_gated_updates_match_their_formulas_and_gradcheck(traced):
    g = _gen(7)
    b, n, m, e = 2, 11, 5, 6
    h = torch.randn(b, n, e, generator=g, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(b, n, generator=g, dtype=torch.float64, requires_grad=True)
    delta = torch.randn(b, n, e, generator=g, dtype=torch.float64, requires_grad=True)
    wrap = _compiled if traced else (lambda f: f)
    torch.testing.assert_close(wrap(fr._gated_residual)(h, gate, delta), h + gate[..., None] * delta)
    torch.testing.assert_close(wrap(fr._gated_mix)(h, gate, delta), h + gate[..., None] * (delta - h))
    idx = torch.stack([torch.randperm(n, generator=g)[:m].sort().values for _ in range(b)])
    flat = (idx + torch.arange(b).unsqueeze(1) * n).reshape(-1)
    upd = torch.randn(b, m, e, generator=g, dtype=torch.float64, requires_grad=True)
    base = torch.randn(b, m, e, generator=g, dtype=torch.float64, requires_grad=True)
    got = wrap(fr._gated_scatter)(h, flat, idx, gate, upd, base)
    ref = h.detach().clone()
    for i in range(b):
        for j in range(m):
            ref[i, idx[i, j]] += gate[i, idx[i, j]].detach() * (upd[i, j] - base[i, j]).detach()
    torch.testing.assert_close(got, ref)
    if not traced:
        torch.autograd.gradcheck(fr._gated_scatter, (h, flat, idx, gate, upd, base))
        torch.autograd.gradcheck(fr._gated_residual, (h, gate, delta))
        torch.autograd.gradcheck(fr._gated_mix, (h, gate, delta))


@pytest.mark.parametrize("with_active", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_expert_choice_select_against_a_step_by_step_reference(with_active, traced):
    g = _gen(11)
    b, n, k = 3, 13, 4
    logit = torch.randn(b, n, generator=g, dtype=torch.float64, requires_grad=True)
    bce_logit = logit.detach().clone().requires_grad_()
    active = torch.rand(b, n, generator=g) > 0.3 if with_active else None
    if active is not None:
        active[:, :k] = True  # at least k candidates per sequence
    pos = torch.arange(n).expand(b, n) + 100
    reach, depth, expected = (
        torch.rand(b, n, generator=g, dtype=torch.float64),
        torch.ones(b, n),
        torch.ones(b, n),
    )
    fn = fr._expert_choice_select if not traced else _compiled(fr._expert_choice_select)
    gate, idx, flat, sel_pos, selected, z, bce, reach2, depth2, exp2 = fn(
        logit, bce_logit, active, pos, reach, depth, expected, k, 0.5
    )
    cand = torch.ones(b, n, dtype=torch.bool) if active is None else active
    for i in range(b):
        scores = [(logit[i, t].item(), t) for t in range(n) if cand[i, t]]
        want = sorted(t for _, t in sorted(scores, reverse=True)[:k])
        assert idx[i].tolist() == want
        assert sel_pos[i].tolist() == [100 + t for t in want]
        assert flat[i * k : (i + 1) * k].tolist() == [i * n + t for t in want]
        assert selected[i].nonzero().flatten().tolist() == want
    torch.testing.assert_close(gate, 0.5 * torch.sigmoid(logit))
    torch.testing.assert_close(z, logit.pow(2)[cand].mean())
    target = selected.to(torch.float64)
    torch.testing.assert_close(bce, F.binary_cross_entropy_with_logits(bce_logit[cand], target[cand]))
    torch.testing.assert_close(reach2, reach * torch.sigmoid(logit))
    torch.testing.assert_close(depth2, depth + target.float())
    torch.testing.assert_close(exp2, expected + reach2)
    assert math.isfinite(float(bce.detach()))


def test_dispatch_counts_the_path_and_can_be_switched_off():
    before = fr.compiled_routing_counts().get("gated_residual:eager", 0)
    h = torch.randn(1, 3, 4)
    fr.gated_residual(h, torch.rand(1, 3), torch.randn(1, 3, 4))
    assert fr.compiled_routing_counts()["gated_residual:eager"] == before + 1  # CPU: op by op
    was = fr.compiled_routing_enabled()
    fr.set_compiled_routing(False)
    try:
        assert not fr.compiled_routing_enabled()
    finally:
        fr.set_compiled_routing(was)


def test_compiled_path_keeps_a_cache_per_name_and_leaves_no_grad_calls_op_by_op(monkeypatch):
    """What a training run does to the routing glue: both router variants, several routed lengths,
    no-grad validation calls in between. With torch.compile's recompile limit squeezed to 1, one
    code object shared by the two router variants (and compiled no-grad calls) would exceed it —
    as a 100M run on the H100 did at the default of 8 — and fail over to op by op."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(fr, "_compiled", {})
    monkeypatch.setattr(fr, "_counts", __import__("collections").Counter())
    monkeypatch.setattr(fr, "_compile_here", lambda t: True)  # the CPU stands in for CUDA
    monkeypatch.setattr(fr, "_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(fr.OPTIONS, "compiled_routing", True)
    with torch._dynamo.config.patch(recompile_limit=1):
        g = _gen(11)
        w, b = torch.randn(16, generator=g, requires_grad=True), torch.zeros((), requires_grad=True)
        for n in (7, 12, 19):
            h = torch.randn(2, n, 16, generator=g, requires_grad=True)
            for detached in (True, False):
                logit, _ = fr.router_logits(h, w, b, with_detached=detached)
                ref = F.rms_norm(h, (16,), eps=1e-6) @ w + b
                torch.testing.assert_close(logit, ref, rtol=1e-5, atol=1e-5)
                logit.sum().backward()
            with torch.no_grad():
                fr.router_logits(h, w, b, with_detached=False)
                fr.gated_residual(h, torch.rand(2, n), h)
            fr.gated_residual(h, torch.rand(2, n), h).sum().backward()
    counts = fr.compiled_routing_counts()
    assert not [k for k in counts if k.endswith(":failed")], counts
    assert counts["router_logits:compiled"] == 3 and counts["router_logit:compiled"] == 3
    assert counts["gated_residual:compiled"] == 3 and counts["gated_residual:eager"] == 3
    assert counts["router_logits:no_grad"] == 3  # the no-grad router calls: hydra_kernels' op
    assert "router_logits:eager" not in counts
    torch._dynamo.reset()


@pytest.mark.parametrize("triton_path", [False, True])
def test_a_no_grad_router_call_takes_one_kernel_and_gives_the_eager_logits(triton_path):
    """Evaluation and prefill: hydra_kernels' router_logit (the kernel under the interpreter, or
    its reference) against the op-by-op eager form, on a strided [B, n, E] stream."""
    import hydra_kernels

    hydra_kernels.set_use_triton_kernels(triton_path)
    g = _gen(int.from_bytes(__import__("os").urandom(2), "little"))
    h = torch.randn(2, 9, 40, generator=g)[:, :, 4:36]  # rows strided by the wider buffer
    w, b = torch.randn(32, generator=g), torch.randn((), generator=g)
    with torch.no_grad():
        got, none = fr.router_logits(h, w, b, with_detached=False)
    want, _ = fr._router_logits_eager(h, w, b, 1e-6, False)
    assert none is None and got.shape == (2, 9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_no_grad_router_call_under_autocast_keeps_fp32():
    """Autocast must not run the router's product in half precision (the eager form switches it
    off; so does hydra_kernels' router_logit and its reference)."""
    g = _gen(3)
    h = 1 + torch.randn(1, 5, 512, generator=g)
    w, b = torch.randn(512, generator=g), torch.zeros(())
    want = ((h.double() @ w.double()) / torch.sqrt(h.double().pow(2).mean(-1) + 1e-6)).float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fr.router_logits(h, w, b, with_detached=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_traced_router_logits_are_the_same_under_autocast_without_switching_it_off():
    """The compiled form has no autocast context (one in a traced forward makes torch skip its
    AOTAutograd cache); its ops are ones autocast leaves alone, so under a bf16 autocast its
    logits are bit for bit those with autocast off (a matmul there would run in bf16)."""
    g = _gen(11)
    h = (1 + torch.randn(2, 7, 96, generator=g)).to(torch.bfloat16)
    w, b = torch.randn(96, generator=g), torch.randn((), generator=g)
    with torch.autocast("cpu", enabled=False):
        want = fr._router_logits(h, w, b, 1e-6, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fr._router_logits(h, w, b, 1e-6, True)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y)
