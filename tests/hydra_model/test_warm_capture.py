"""A graphed decoder whose step ran before in this process captures at once, with no eager warm-up
step (decode_graphs.py, decoder_hold.warm_signature): the same tokens and routing counts as a
decoder that warmed up, and a capture that would have made state the step reads is dropped.
The cache's snapshot and rollback, which that relies on, are tested on the CPU."""

import pytest
import torch

from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import StagedDecoder
from hydra_model.decoder_hold import Fingerprint, is_warm, request_of, start_keep, warm_signature

from .conftest import MODES, random_tokens, small_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_a_rollback_restores_the_references_a_snapshot_took():
    cache = ModelCache(capacity=8)
    slot = cache.slot(0, 0)
    cache.counts[(1, -1)] = torch.zeros(2, dtype=torch.long)
    before = cache.snapshot()
    assert cache.same_references(before, cache.snapshot())
    cache.counts[(3, -1)] = torch.zeros(2, dtype=torch.long)  # made, as a capture might
    cache.slot(1, 0)
    slot.entry = object()
    cache.conv_bank.weights[("m", "window")] = (torch.zeros(1), torch.zeros(1))
    cache.position = torch.zeros(2, 1, dtype=torch.long)
    cache.seq_len += 1
    assert not cache.same_references(before, cache.snapshot())
    cache.rollback(before)
    assert cache.same_references(before, cache.snapshot()) and cache.seq_len == before[-1]
    assert list(cache.counts) == [(1, -1)] and list(cache.slots) == [(0, 0)] and slot.entry is None
    assert cache.position is None and not cache.conv_bank.weights
    cache.seq_len += 1  # the host's count alone is not a reference
    assert cache.same_references(before, cache.snapshot())


def test_the_warm_signature_follows_shapes_switches_and_the_request_not_the_storage():
    model, cpu = small_model().eval(), torch.device("cpu")
    sig = warm_signature(model, "graphs", 2, 16, cpu)
    assert sig == warm_signature(model, "graphs", 2, 16, cpu)
    assert sig != warm_signature(model, "graphs", 3, 16, cpu) and sig != warm_signature(
        model, "graphs", 2, 17, cpu
    )
    twin = small_model(seed=5).eval()  # other weights, other storage, the same shapes
    assert warm_signature(twin, "graphs", 2, 16, cpu) == sig
    assert warm_signature(twin.double(), "graphs", 2, 16, cpu) != sig
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a half-precision cache and stream
        assert warm_signature(model, "graphs", 2, 16, cpu) != sig
    with torch.inference_mode():
        assert warm_signature(model, "graphs", 2, 16, cpu) != sig


@pytest.mark.parametrize("name", ["gpt", *MODES])
def test_a_decode_step_makes_nothing_its_decoder_did_not(name):
    """What a capture-first step relies on, checked eagerly: once a decoder is built on a
    prefilled cache, running every stage of a step (the capture runs the same code) makes no
    position, counter, slot entry or conv weight."""
    model = build_model("gpt", "tiny").eval() if name == "gpt" else small_model(**MODES[name]).eval()
    prompt = random_tokens(2, 7)
    cache = ModelCache(capacity=16)
    with torch.no_grad():
        model(prompt, cache=cache)
        decoder = StagedDecoder(model, cache, 2, prompt.device, "staged")
        before = cache.snapshot()
        for segment in decoder.segments:
            segment.run_stages()
    assert cache.same_references(before, cache.snapshot())


@pytest.mark.parametrize("name", ["gpt", *MODES])
def test_a_graphed_decoder_takes_the_models_structure_once_for_its_signature_and_its_keep(name):
    """The structure a graphed decoder takes when it is built (after the prefill) is what a
    fresh fingerprint takes after the generation's steps, and keeping the decoder reuses it."""
    model = build_model("gpt", "tiny").eval() if name == "gpt" else small_model(**MODES[name]).eval()
    prompt, cpu = random_tokens(2, 7), torch.device("cpu")
    cache = ModelCache(capacity=16)
    with torch.no_grad():
        model(prompt, cache=cache)
        graphed = StagedDecoder(model, cache, 2, cpu, "graphs")  # built, never stepped here
        assert graphed._signature == warm_signature(model, "graphs", 2, 16, cpu)
        staged = StagedDecoder(model, cache, 2, cpu, "staged")
        for _ in range(3):  # a generation's steps
            staged.step(torch.randint(0, model.config.vocab_size, (2,)))
    assert Fingerprint(model).structure == graphed.fingerprint.structure
    assert staged.fingerprint is None  # a decoder that never captures takes none
    pending = start_keep(model, None, graphed, request_of(model, "graphs", 2, 16, cpu), 7)
    assert pending._pending[2] is graphed.fingerprint


@CUDA
@pytest.mark.parametrize("mode", ["gpt", *MODES])
def test_a_second_decoder_of_a_warm_signature_captures_at_once_and_gives_the_same_tokens(mode):
    model = build_model("gpt", "tiny").eval() if mode == "gpt" else small_model(**MODES[mode]).eval()
    model = model.cuda()
    prompt = random_tokens(2, 7).cuda()
    want = model.generate(prompt, 12, decode="staged", keep_decoder=False)
    staged = model.last_decode_report
    first = model.generate(prompt, 12, decode="graphs", keep_decoder=False)
    report = model.last_decode_report
    assert report.extra["warm_up_step"] and report.capture == "one graph", report
    got = model.generate(prompt, 12, decode="graphs", keep_decoder=False)
    warm = model.last_decode_report
    assert not warm.extra["warm_up_step"] and warm.capture == "one graph" and warm.reason is None, warm
    assert torch.equal(first, want) and torch.equal(got, want)
    assert (warm.gated_run, warm.gated_skipped) == (staged.gated_run, staged.gated_skipped)


@CUDA
def test_a_capture_that_makes_a_counter_is_dropped_for_the_warm_up():
    """The routing counters deleted after the prefill: the step makes them (at zero) the first
    time it runs, so a capture-first step would make them inside its graph (never computed,
    and zeroed again at every replay). The capture is dropped and rolled back; the step warms up
    and is captured as usual, and decodes as the staged steps do on the same cache."""
    torch.manual_seed(0)
    routed = dict(n_mor_blocks=5, recursions_per_block=1, mod_capacity=0.5, mod_block_stride=2)
    model = build_model("hydra", "tiny", **routed).eval().cuda()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), device="cuda")
    model.generate(prompt, 10, decode="graphs", keep_decoder=False)  # capacity 16 warms up
    tokens = {}
    for mode in ("staged", "graphs"):
        cache = ModelCache(capacity=16)
        with torch.no_grad():
            logits = model(prompt, cache=cache).logits[:, -1]
            assert cache.counts
            cache.counts.clear()
            decoder = StagedDecoder(model, cache, 1, prompt.device, mode)
            assert mode == "staged" or is_warm(decoder._signature)
            out = []
            for _ in range(8):
                nxt = logits.argmax(-1)
                out.append(nxt)
                logits = decoder.step(nxt)
        tokens[mode] = torch.stack(out)
        if mode == "graphs":
            assert decoder.report.extra["warm_up_step"] and decoder.report.capture == "one graph"
            assert "made state" in decoder.report.extra["capture_first_dropped"]
    assert torch.equal(tokens["graphs"], tokens["staged"])
