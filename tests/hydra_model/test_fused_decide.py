"""The fused decode-time routing decision (hydra_model/fused_decide.py, one hydra_kernels launch)
decides as the op-by-op path does: same tokens, same counters, same skipped blocks.

It runs on a GPU by default; these tests force it onto CPU tensors (``fused_decide("on")``) with
hydra_kernels' Triton kernels switched on, so that the kernel itself runs under Triton's
interpreter (the suite's conftest sets TRITON_INTERPRET=1 without a GPU). Both sides of each
comparison run with the same kernel switches, so only the decision differs in how it is computed.
"""

import pytest
import torch

import hydra_kernels
from hydra_kernels import controls
from hydra_kernels.ops import router_decide as rd_mod
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import StagedDecoder
from hydra_model.fused_decide import fused_decide, fused_decide_applies, fused_decide_mode, set_fused_decide

from .test_decode_graphs import routed_model

pytestmark = pytest.mark.skipif(
    not controls.device_supports_triton(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (no GPU)"
)


@pytest.fixture
def triton_on():
    """hydra_kernels' Triton kernels on (the suite's conftest switches them off and back)."""
    hydra_kernels.set_use_triton_kernels(True)


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Counts the fused kernel's launches (one entry each, the batch size)."""
    seen: list[int] = []
    launch = rd_mod.router_decide_launch

    def counting(h, *args):
        seen.append(h.shape[0])
        return launch(h, *args)

    monkeypatch.setattr(rd_mod, "router_decide_launch", counting)
    return seen


def varied_case(batch: int, new_tokens: int, tries: int = 8):
    """A routed model and prompt whose op-by-op staged decoding both runs and skips a routed block
    (at batch > 1: runs one), found with the kernels off (fast); seeds are fresh."""
    hydra_kernels.set_use_triton_kernels(False)
    try:
        for _ in range(tries):
            model = routed_model(seed=torch.seed() % 2**31)
            prompt = torch.randint(0, model.config.vocab_size, (batch, 6))
            model.generate(prompt, new_tokens, decode="staged")
            report = model.last_decode_report
            if report.gated_run > 0 and (report.gated_skipped > 0 or batch > 1):
                return model, prompt
    finally:
        hydra_kernels.set_use_triton_kernels(True)
    pytest.fail(f"no seed of {tries} gave a decoding that both runs and skips a routed block")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("decode", ["staged", "eager"])
def test_fused_generation_gives_the_unfused_tokens(batch, decode, triton_on, launches):
    new = 10
    model, prompt = varied_case(batch, new)
    with fused_decide("off"):
        unfused = model.generate(prompt, new, decode=decode)
        ref = model.last_decode_report
    assert not launches  # "off": the op-by-op path
    with fused_decide("on"):
        fused = model.generate(prompt, new, decode=decode)
        report = model.last_decode_report
    assert torch.equal(fused, unfused), f"fused {fused.tolist()} vs unfused {unfused.tolist()}"
    # every decision of every step ran the kernel: 2 routed blocks, new − 1 decode steps
    assert launches == [batch] * (2 * (new - 1))
    if decode == "staged":
        assert (report.gated_run, report.gated_skipped) == (ref.gated_run, ref.gated_skipped)


def test_fused_stages_keep_the_counters_and_the_decisions(triton_on, launches):
    """Step by step, a staged decoder deciding fused against the model's own (op-by-op) decode
    step on the same tokens: equal logits and equal counters (each the running sum of its point's
    decisions, so a single differing decision shows)."""
    model = routed_model(seed=torch.seed() % 2**31)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (2, 7))
    ref_cache, cache = ModelCache(capacity=40), ModelCache(capacity=40)
    routed = [blk for blk in model.blocks if blk.routed]
    took = 0
    with torch.no_grad():
        with fused_decide("off"):
            model(prompt, cache=ref_cache)
            model(prompt, cache=cache)
            decoder = StagedDecoder(model, cache, 2, prompt.device, "staged")
        for _ in range(12):
            nxt = torch.randint(0, vocab, (2,))  # the same tokens for both
            with fused_decide("off"):
                ref_logits = model(nxt.view(2, 1), cache=ref_cache).logits[:, -1]
            with fused_decide("on"):
                logits = decoder.step(nxt)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            for blk in routed:
                key = blk.causal.key
                assert torch.equal(cache.counts[key], ref_cache.counts[key]), key
            took += sum(int(c.sum()) for c in (cache.counts[blk.causal.key] for blk in routed))
    assert len(launches) == 2 * 12 and took > 0


def test_auto_keeps_the_cpu_on_the_op_by_op_path(triton_on):
    h = torch.randn(2, 1, 16)
    pos = torch.zeros(2, 1, dtype=torch.long)
    assert fused_decide_mode() == "auto"
    assert not fused_decide_applies(h, pos)  # CPU, even with the kernels on and interpreted
    with fused_decide("on"):
        assert fused_decide_applies(h, pos)
        assert not fused_decide_applies(h.double(), pos)  # the kernel computes in fp32
        w = torch.randn(16, requires_grad=True)
        assert not fused_decide_applies(h, pos, (w,))  # grad on and a parameter needs it
        with torch.no_grad():
            assert fused_decide_applies(h, pos, (w,))
    with pytest.raises(ValueError, match="fused decide mode"):
        set_fused_decide("always")
    assert fused_decide_mode() == "auto"
