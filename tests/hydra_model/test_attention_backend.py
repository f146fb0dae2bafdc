"""flexible_attention against an fp64 softmax reference; backend selection and fallback counting."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import hydra_model.attention_backend as ab
from hydra_model import (
    attention_fallback_counts,
    flexible_attention,
    get_attention_backend,
    set_attention_backend,
)


def _reference(q, k, v, causal, mask=None, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        s, length = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(s, length, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.fixture(autouse=True)
def _restore_backend():
    before = get_attention_backend()
    yield
    set_attention_backend(before)


@pytest.mark.parametrize(("hq", "hkv", "s", "d"), [(4, 2, 13, 8), (6, 1, 7, 12), (3, 3, 1, 16)])
def test_causal_gqa_matches_reference(hq, hkv, s, d):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, hq, s, d), torch.randn(2, hkv, s, d), torch.randn(2, hkv, s, d)
    out = flexible_attention(q, k, v, causal=True, scale=0.37)
    torch.testing.assert_close(out.double(), _reference(q, k, v, True, scale=0.37), atol=1e-5, rtol=1e-5)
    same = flexible_attention(q, k, v, is_causal=True, scale=0.37)
    torch.testing.assert_close(same, out)


def test_mask_for_decoding_against_a_cache():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8)
    lengths = torch.tensor([1, 5, 9])
    mask = (torch.arange(9).view(1, -1) < lengths.view(-1, 1)).view(3, 1, 1, 9)
    out = flexible_attention(q, k, v, causal=False, attn_mask=mask)
    torch.testing.assert_close(out.double(), _reference(q, k, v, False, mask), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_with_a_reason():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        flexible_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="as many queries as keys"):
        flexible_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), causal=True)
    with pytest.raises(ValueError, match="unknown attention backend"):
        set_attention_backend("fastest")


@pytest.mark.skipif(ab.FLASH_ATTN_AVAILABLE, reason="checks the fallback when flash-attn is absent")
def test_requested_backend_that_cannot_run_falls_back_counted(caplog):
    set_attention_backend("flash")
    before = attention_fallback_counts().get("flash->sdpa: not installed", 0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    with caplog.at_level(logging.INFO, logger="hydra_model.attention_backend"):
        out = flexible_attention(q, k, v)
        flexible_attention(q, k, v)
    torch.testing.assert_close(out.double(), _reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    assert attention_fallback_counts()["flash->sdpa: not installed"] == before + 2
    assert get_attention_backend() == "flash"


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("HYDRA_ATTENTION_BACKEND", "sdpa")
    ab.reload_attention_env()
    assert get_attention_backend() == "sdpa"
    monkeypatch.setenv("HYDRA_ATTENTION_BACKEND", "magic")
    with pytest.raises(ValueError, match="HYDRA_ATTENTION_BACKEND"):
        ab.reload_attention_env()
    monkeypatch.setenv("HYDRA_ATTENTION_BACKEND", "auto")
    monkeypatch.setenv("HYDRA_SDPA_FLASH_ONLY", "1")
    monkeypatch.setenv("HYDRA_SDPA_NO_FLASH", "1")
    with pytest.raises(ValueError, match="contradict"):
        ab.reload_attention_env()
    monkeypatch.delenv("HYDRA_SDPA_FLASH_ONLY")
    ab.reload_attention_env()
    try:
        assert ab.OPTIONS.sdpa_no_flash and not ab.OPTIONS.sdpa_flash_only
        torch.manual_seed(2)
        q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        out = flexible_attention(q, k, v)  # SDPA restricted away from its flash kernel
        torch.testing.assert_close(out.double(), _reference(q, k, v, True), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.delenv("HYDRA_SDPA_NO_FLASH")
        monkeypatch.delenv("HYDRA_ATTENTION_BACKEND")
        ab.reload_attention_env()


def test_auto_on_cpu_uses_sdpa_without_measuring():
    set_attention_backend("auto")
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    flexible_attention(q, k, v)
    assert ab._auto_impl(q, k, v, True, None, None)[0] == "sdpa"
    assert not ab._auto_choice  # nothing measured off CUDA


def test_measurement_picks_a_working_candidate_even_inside_a_checkpoint():
    """auto's measuring (run on CUDA in practice) exercised on CPU tensors: every candidate is
    timed or recorded with its error, the fastest working one is cached and reused for the same
    heads under compile, and measuring inside a checkpointed forward leaves that forward intact."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    q, k, v = (torch.randn(1, h, 9, 8, requires_grad=True) for h in (4, 2, 2))
    sig = ("cpu", "float32", 1, 4, 2, 9, 9, 8, True, True)
    ab._auto_choice.pop(sig, None)
    choices = []

    def fn(q, k, v):
        choices.append(ab._measure(sig, q, k, v, True, None, needs_grad=True))
        return flexible_attention(q, k, v)

    out = checkpoint(fn, q, k, v, use_reentrant=False)
    out.sum().backward()
    ref_q = q.detach().requires_grad_()
    flexible_attention(ref_q, k.detach(), v.detach()).sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad)
    try:
        report = ab.attention_autotune_report()[ab._describe(sig)]
        # measured in the forward and again in the recompute (this test calls _measure itself)
        assert len(choices) == 2
        assert report["chosen"] == choices[-1] and isinstance(report[choices[-1]], float)
        assert set(report) >= {"sdpa", "sdpa_cudnn", "sdpa_efficient", "chosen", "sdpa_runs"}
        assert ab._family_choice(("float32", 4, 2, 8, True, True)) == choices[-1]
        assert ab._family_choice(("float32", 4, 2, 16, True, True)) is None
    finally:
        ab._auto_choice.pop(sig, None)
        ab._auto_report.pop(sig, None)


def test_switches_live_in_one_options_object(monkeypatch):
    """The environment variables and the set_* functions are entry points onto
    hydra_model.model_options; the backends and the routing glue read it there."""
    import hydra_model
    from hydra_model import fused_routing, options

    opts = hydra_model.model_options
    assert opts is options.OPTIONS
    monkeypatch.setenv("HYDRA_COMPILED_ROUTING", "0")
    monkeypatch.setenv("HYDRA_ATTENTION_BACKEND", "sdpa")
    try:
        options.reload_env()
        assert not opts.compiled_routing and not fused_routing.compiled_routing_enabled()
        assert opts.attention_backend == "sdpa" == get_attention_backend()
        fused_routing.set_compiled_routing(True)
        set_attention_backend("auto")
        assert opts.compiled_routing and opts.attention_backend == "auto"
    finally:
        monkeypatch.delenv("HYDRA_COMPILED_ROUTING")
        monkeypatch.delenv("HYDRA_ATTENTION_BACKEND")
        options.reload_env()


def _compile_branch_on_cpu(monkeypatch) -> None:
    """auto's compile branch made to run on CPU tensors, with one more candidate, ``probe``: plain
    SDPA doubled, so that an output shows which pick a compiled forward runs."""
    monkeypatch.setattr(ab, "_measurable", lambda q, mask: mask is None)
    plain = {"sdpa": lambda *a: ab._run_sdpa(*a), "probe": lambda *a: 2 * ab._run_sdpa(*a)}
    monkeypatch.setattr(ab, "_candidates", lambda q, k: plain)


def test_a_compiled_forward_keeps_the_choice_it_traced_with(monkeypatch):
    """Under torch.compile auto's pick is a constant of the trace: a measurement made after it
    (an eager evaluation's, say) neither recompiles the forward nor changes what it runs; a new
    trace takes the measurement. Reading the choices as a dict had made them guards, and
    hydra-train compiled the whole forward twice."""
    from torch._dynamo.testing import CompileCounter

    _compile_branch_on_cpu(monkeypatch)
    before = get_attention_backend()
    set_attention_backend("auto")
    sig = ("cpu", "float32", 3, 4, 2, 9, 9, 8, True, False)
    ab._auto_choice.pop(sig, None)
    counter = CompileCounter()
    attend = torch.compile(flexible_attention, backend=counter, fullgraph=True)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    want = _reference(q, k, v, True)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            first = attend(q, k, v)  # traced with nothing measured for the family: plain SDPA
            ab._auto_choice[sig] = "probe"  # measured afterwards (another batch and length)
            second = attend(q, k, v)
            assert counter.frame_count == 1
            torch._dynamo.reset()
            third = attend(q, k, v)  # a new trace takes the measurement
        assert counter.frame_count == 2
        for out, factor in ((first, 1), (second, 1), (third, 2)):
            torch.testing.assert_close(out.double(), factor * want, atol=1e-5, rtol=1e-5)
    finally:
        ab._auto_choice.pop(sig, None)
        set_attention_backend(before)
        torch._dynamo.reset()


def test_switching_backends_keeps_measured_choices_and_reloading_the_env_forgets_them():
    sig = ("cuda:0", "bfloat16", 1, 4, 2, 8, 8, 8, True, False)
    before = get_attention_backend()
    ab._auto_choice[sig] = "sdpa_flash"
    try:
        set_attention_backend("sdpa")
        set_attention_backend("auto")
        assert ab._auto_choice.get(sig) == "sdpa_flash"
        assert (("bfloat16", 4, 2, 8, True, False), "sdpa_flash") in ab._measured_families()
        ab.reload_attention_env()
        assert sig not in ab._auto_choice
    finally:
        ab._auto_choice.pop(sig, None)
        set_attention_backend(before)


@pytest.mark.parametrize("dynamic", [True, None])
def test_auto_under_compile_takes_the_family_pick_at_symbolic_shapes(monkeypatch, dynamic):
    """auto's compile branch traces at three lengths, with dynamic shapes or after one length was
    seen: the family's pick is found with symbolic shapes (a constant function cannot take them),
    without a recompile per length, and gives the fp64 reference's results."""
    from torch._dynamo.testing import CompileCounter

    _compile_branch_on_cpu(monkeypatch)
    before = get_attention_backend()
    set_attention_backend("auto")
    family_sig = ("cpu", "float32", 1, 4, 2, 5, 5, 8, True, False)  # a measured shape of the family
    ab._auto_choice[family_sig] = "probe"
    counter = CompileCounter()
    attend = torch.compile(flexible_attention, backend=counter, dynamic=dynamic, fullgraph=True)
    try:
        torch._dynamo.reset()
        for n in (7, 11, 13):
            q, k, v = torch.randn(2, 4, n, 8), torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 8)
            with torch.no_grad():
                out = attend(q, k, v)
            torch.testing.assert_close(out.double(), 2 * _reference(q, k, v, True), atol=1e-5, rtol=1e-5)
        assert counter.frame_count <= 2  # dynamic: one trace; None: a static one, then a dynamic one
    finally:
        ab._auto_choice.pop(family_sig, None)
        set_attention_backend(before)
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto times CUDA candidates on the GPU")
def test_auto_times_candidates_by_their_gpu_time_not_the_hosts(monkeypatch):
    """On CUDA a candidate's time is what it keeps the GPU busy, which the compiled and graphed
    step sees: one with 3 ms of host work a call before plain SDPA's kernels (an eager timing
    puts it above 3 ms) times within 0.5 ms of plain SDPA here; the pick is the fastest time,
    and the device is left usable (an fp32 call after it matches an fp64 reference)."""
    import time

    dev = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 256, 64, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 256, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))

    def slow_host(*a):
        time.sleep(0.003)
        return ab._run_sdpa(*a)

    real = ab._candidates
    monkeypatch.setattr(ab, "_candidates", lambda q, k: {**real(q, k), "slow_host": slow_host})
    sig = ("cuda:test", "bfloat16", 2, 4, 2, 256, 256, 64, True, True)
    try:
        choice = ab._measure(sig, q, k, v, True, None, needs_grad=True)
        report = ab._auto_report[sig]
        timed = {n: t for n, t in report.items() if isinstance(t, float)}
        assert {"sdpa", "slow_host"} <= set(timed)
        assert timed["slow_host"] < timed["sdpa"] + 0.5, report
        assert choice == min(timed, key=timed.get) == report["chosen"]
    finally:
        ab._auto_choice.pop(sig, None)
        ab._auto_report.pop(sig, None)
    qf, kf, vf = q.float(), k.float(), v.float()
    out = flexible_attention(qf, kf, vf)
    want = _reference(qf.cpu(), kf.cpu(), vf.cpu(), True)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sdpa_own_kernel_names_the_kernel_plain_sdpa_runs(device):
    """The kernel named for plain SDPA's own dispatch gives plain SDPA's output bit for bit when
    SDPA is restricted to it (fresh inputs, causal GQA, with and without gradients; bf16 on CUDA,
    where SDPA has several kernels to choose from)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    for needs_grad in (False, True):
        qkv = [torch.randn(2, h, 128, 64, device=device, dtype=dtype) for h in (4, 2, 2)]
        name = ab.sdpa_own_kernel(*qkv, True, None, needs_grad)
        assert name in backends
        results = []
        for kernels in (None, [backends[name]]):
            q, k, v = (t.clone().requires_grad_(needs_grad) for t in qkv)
            with torch.enable_grad() if needs_grad else torch.no_grad():
                with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=True
                    )
                if needs_grad:
                    out.backward(torch.ones_like(out))
            results.append([out.detach(), *([q.grad, k.grad, v.grad] if needs_grad else [])])
        for plain, only in zip(*results, strict=True):
            assert torch.equal(plain, only)


def test_a_pick_is_sdpas_own_kernel_only_when_it_runs_that_kernel_unchanged():
    assert ab.same_kernel_as_sdpa({"chosen": "sdpa", "sdpa_runs": "cudnn"})
    assert ab.same_kernel_as_sdpa({"chosen": "sdpa_cudnn", "sdpa_runs": "cudnn"})
    assert not ab.same_kernel_as_sdpa({"chosen": "sdpa_flash", "sdpa_runs": "cudnn"})
    assert not ab.same_kernel_as_sdpa({"chosen": "sdpa_cudnn+expand", "sdpa_runs": "cudnn"})  # K/V copied
    assert not ab.same_kernel_as_sdpa({"chosen": "sdpa_unknown", "sdpa_runs": "unknown"})
    assert not ab.same_kernel_as_sdpa({"chosen": "flash", "sdpa_runs": "flash"})  # flash-attn's own
