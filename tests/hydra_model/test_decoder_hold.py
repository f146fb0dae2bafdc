"""A decoder kept from one ``generate`` for the next (decoder_hold.py): reused only when nothing it
captured changed, its cache refilled in place, and then the tokens of a decoder built afresh."""

import copy
import pickle

import pytest
import torch

from hydra_model import build_model
from hydra_model import cache as cache_mod
from hydra_model.cache import ModelCache
from hydra_model.decoder_hold import CAPACITY_STEP, cache_capacity, model_fingerprint
from hydra_model.options import OPTIONS

from .conftest import MODES, random_tokens, small_model

CASES = {
    "hydra_mor": dict(seed=3),  # routed middle block, three causal recursions
    "hydra_mod": dict(seed=4, n_mor_blocks=5, recursions_per_block=1, mod_capacity=0.5, mod_block_stride=2),
    "token_choice": dict(seed=5, **MODES["token_choice"]),
}


def case_model(name: str) -> torch.nn.Module:
    if name == "gpt":
        torch.manual_seed(0)
        return build_model("gpt", "tiny").eval()
    return small_model(**CASES[name]).eval()


def storage(cache) -> list[int]:
    out = [cache.position.data_ptr()] + [c.data_ptr() for c in cache.counts.values()]
    for slot in cache.slots.values():
        e = slot.entry
        out += [t.data_ptr() for t in (e.k, e.v, e.length, e.bias, e.window, e.prev_v) if t is not None]
    return out


@pytest.mark.parametrize("name", [*CASES, "gpt"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_kept_decoder_gives_the_tokens_of_a_new_one_on_the_same_tensors(name, batch):
    """Three generations of one total length (prompts of 6 and 9 tokens): the second and third
    reuse the first's decoder, write into the cache tensors it captured, and give the tokens of a
    decoder built for that prompt alone."""
    model = case_model(name)
    vocab = model.config.vocab_size
    prompts = [random_tokens(batch, 6, vocab, seed=11), random_tokens(batch, 9, vocab, seed=12)]
    prompts.append(random_tokens(batch, 6, vocab, seed=13))
    fresh = [model.generate(p, 21 - p.shape[1], decode="staged", keep_decoder=False) for p in prompts]
    assert model._decoder_hold.held is None  # keep_decoder=False keeps none
    first = model.generate(prompts[0], 15, decode="staged")
    decoder = model._decoder_hold.held.decoder
    kept = storage(decoder.cache)
    assert not model.last_decode_report.reused
    for prompt, want in zip(prompts[1:], fresh[1:], strict=True):
        got = model.generate(prompt, 21 - prompt.shape[1], decode="staged")
        report = model.last_decode_report
        assert report.reused and report.not_reused is None and report.capture_ms == 0.0
        assert report.steps == 21 - prompt.shape[1] - 1
        assert model._decoder_hold.held.decoder is decoder
        assert storage(decoder.cache) == kept
        assert torch.equal(got, want)
    assert torch.equal(first, fresh[0])


def test_a_prefill_that_replaces_a_tensor_builds_a_new_decoder(monkeypatch):
    """The storage check is what keeps a captured step from reading stale tensors: a restart that
    drops the spare entries makes the prefill allocate new ones, and the decoder is not reused."""
    model = case_model("hydra_mod")
    prompt, other = random_tokens(1, 6, seed=21), random_tokens(1, 6, seed=22)
    model.generate(prompt, 10, decode="staged")
    want = model.generate(other, 10, decode="staged", keep_decoder=False)
    model.generate(prompt, 10, decode="staged")
    restart = cache_mod.ModelCache.restart

    def restart_dropping_spares(self, **kwargs):
        restart(self, **kwargs)
        for slot in self.slots.values():
            slot.spare = None

    monkeypatch.setattr(cache_mod.ModelCache, "restart", restart_dropping_spares)
    got = model.generate(other, 10, decode="staged")
    report = model.last_decode_report
    assert not report.reused and "replaced a cache tensor" in report.not_reused
    assert torch.equal(got, want)


def test_changed_weights_or_switches_are_not_replayed(monkeypatch):
    """A weight changed through ``.data`` (no version bump, as under a replayed training graph) or
    a decode switch flipped: the held decoder is dropped, the report says why, and the tokens
    are those of the changed model."""
    model = case_model("hydra_mor")
    prompt = random_tokens(2, 6, seed=31)
    model.generate(prompt, 10, decode="staged")
    with torch.no_grad():
        model.blocks[1].mor.block.attn.w_o.weight.data.mul_(1.5)
    want = model.generate(prompt, 10, decode="staged", keep_decoder=False)
    model.generate(prompt, 10, decode="staged")  # held again, for the changed weights
    with torch.no_grad():
        model.blocks[1].mor.block.attn.w_o.weight.data.div_(1.5)
    model.generate(prompt, 10, decode="staged")
    assert not model.last_decode_report.reused and "changed" in model.last_decode_report.not_reused
    with torch.no_grad():
        model.blocks[1].mor.block.attn.w_o.weight.data.mul_(1.5)
    got = model.generate(prompt, 10, decode="staged")
    assert "changed" in model.last_decode_report.not_reused and torch.equal(got, want)
    model.generate(prompt, 10, decode="staged")
    assert model.last_decode_report.reused
    other = "headwise" if OPTIONS.decode_conv != "headwise" else "window_gemm"
    monkeypatch.setattr(OPTIONS, "decode_conv", other)
    model.generate(prompt, 10, decode="staged")
    assert not model.last_decode_report.reused and "switches" in model.last_decode_report.not_reused


def test_another_request_is_a_new_decoder_without_a_reason():
    model = case_model("hydra_mor")
    prompt = random_tokens(1, 6, seed=41)
    model.generate(prompt, 10, decode="staged")
    # a total length in the next capacity bucket, then another batch size
    for kwargs in ({"max_new_tokens": 10 + CAPACITY_STEP}, {"input_ids": random_tokens(2, 6, seed=42)}):
        args = {"input_ids": prompt, "max_new_tokens": 10, "decode": "staged", **kwargs}
        model.generate(**args)
        assert not model.last_decode_report.reused and model.last_decode_report.not_reused is None
    model.generate(prompt, 10, decode="eager")  # an eager generation keeps no decoder
    assert model._decoder_hold.held is None


def test_cache_capacity_rounds_up_to_its_step_and_stops_at_max_seq_len():
    assert CAPACITY_STEP == 64
    cases = [(1, 2048, 64), (64, 2048, 64), (65, 2048, 128), (2000, 2048, 2048), (2048, 2048, 2048)]
    cases += [(2049, 2048, 2112), (90, 96, 96), (100, 96, 128)]  # past max_seq_len: rounded all the same
    for total, max_seq_len, want in cases:
        assert cache_capacity(total, max_seq_len) == want, (total, max_seq_len)


@pytest.mark.parametrize("name", [*CASES, "gpt"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prompts_of_other_lengths_reuse_the_decoder_of_their_bucket(name, batch):
    """Prompts of 6, 11 and 17 tokens, 12 new tokens each: totals 18, 23 and 29 share one
    64-position cache, so the second and third generations reuse the first's decoder, and give
    the tokens of a decoder whose cache holds exactly their total (the positions past it masked)."""
    model = case_model(name)
    vocab = model.config.vocab_size
    prompts = [random_tokens(batch, n, vocab, seed=60 + n) for n in (6, 11, 17)]
    exact = [model.generate(p, 12, decode="staged", keep_decoder=False) for p in prompts]
    for i, (prompt, want) in enumerate(zip(prompts, exact, strict=True)):
        got = model.generate(prompt, 12, decode="staged")
        report = model.last_decode_report
        assert report.reused == (i > 0) and report.not_reused is None
        assert model._decoder_hold.held.decoder.cache.capacity == CAPACITY_STEP
        assert torch.equal(got, want)
    eager = model.generate(prompts[2], 12, decode="eager")
    assert torch.equal(eager, exact[2])


def test_copies_and_pickles_hold_no_decoder_and_release_frees_it():
    model = case_model("hydra_mor")
    model.generate(random_tokens(1, 6, seed=51), 8, decode="staged")
    assert model._decoder_hold.held is not None
    twin = copy.deepcopy(model)
    assert twin._decoder_hold.held is None
    thawed = pickle.loads(pickle.dumps(model))
    assert thawed._decoder_hold.held is None
    assert torch.equal(thawed.embed.weight, model.embed.weight)
    assert model.release_decoder() is True and model.release_decoder() is False


def test_the_fingerprint_sees_one_bit_of_one_element():
    model = case_model("hydra_mor")
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    flat = model.blocks[1].mor.block.ffn.w_down.weight.data.view(-1)
    i = torch.randint(0, flat.numel(), ()).item()
    flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf")))
    assert model_fingerprint(model) != before


def test_the_fingerprint_leaves_out_the_statistics_a_forward_writes():
    """Every forward writes the ``stat_*`` buffers and no decode step reads them: a generation
    leaves the fingerprint as it was; a routing threshold (a buffer decoding reads) changes it."""
    model = case_model("hydra_mor")
    before = model_fingerprint(model)
    model.generate(random_tokens(2, 6, seed=61), 6, decode="staged")
    assert model_fingerprint(model) == before
    tau = next(b for name, b in model.named_buffers() if name.endswith("tau"))
    tau.add_(0.5)
    assert model_fingerprint(model) != before


def test_an_eager_prefill_marks_its_length_for_capture_and_the_oldest_goes_first():
    from hydra_model.decoder_hold import MAX_PREFILL_GRAPHS

    model = case_model("hydra_mor")
    for n in range(4, 5 + MAX_PREFILL_GRAPHS):
        model.generate(random_tokens(1, n, seed=n), 20 - n, decode="staged")
    held = model._decoder_hold.held
    assert list(held.prefills) == list(range(5, 5 + MAX_PREFILL_GRAPHS))  # 4 was dropped
    assert all(g is None for g in held.prefills.values())  # CPU: eager prefills, nothing captured
    assert model.last_decode_report.prefill == "eager"


def test_a_flipped_conv_weight_is_not_replayed():
    """A permutation leaves a plain sum as it was; the position-weighted checksum sees it, and the
    tokens are those of the changed weights (the per-generation folded conv weights rebuilt)."""
    model = case_model("hydra_mod")
    prompt = random_tokens(1, 6, seed=71)
    model.generate(prompt, 10, decode="staged")
    conv = model.blocks[1].mor.block.attn.conv_seq.weight
    with torch.no_grad():
        conv.copy_(conv.flip(0))
    got = model.generate(prompt, 10, decode="staged")
    assert not model.last_decode_report.reused and "changed" in model.last_decode_report.not_reused
    assert torch.equal(got, model.generate(prompt, 10, decode="staged", keep_decoder=False))


def test_no_decoder_is_kept_in_training_mode_or_under_a_caching_autocast():
    model = case_model("hydra_mor")
    prompt = random_tokens(1, 6, seed=81)
    model.train()
    model.generate(prompt, 8, decode="staged")  # sampling during training
    assert model.training and model._decoder_hold.held is None
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(prompt, 8, decode="staged")
    assert model._decoder_hold.held is None
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        model.generate(prompt, 8, decode="staged")
        model.generate(prompt, 8, decode="staged")
        assert model.last_decode_report.reused
    model.generate(prompt, 8, decode="staged")  # outside the autocast region: another request
    assert not model.last_decode_report.reused and model.last_decode_report.not_reused is None


def test_inference_mode_and_plain_calls_keep_their_own_decoders():
    """A cache made under inference_mode holds inference tensors, which a plain call may not
    write: the two are different requests."""
    model = case_model("hydra_mor")
    prompt = random_tokens(1, 6, seed=91)
    with torch.inference_mode():
        a = model.generate(prompt, 8, decode="staged")
    b = model.generate(prompt, 8, decode="staged")
    assert not model.last_decode_report.reused and torch.equal(a, b)


def test_a_slot_the_prefill_left_empty_is_not_a_refill():
    model = case_model("hydra_mor")
    prompt = random_tokens(1, 6, seed=95)
    model.generate(prompt, 8, decode="staged")
    cache = model._decoder_hold.held.decoder.cache
    with torch.no_grad():
        cache.restart()
        model(prompt, cache=cache)
        assert cache.refilled_in_place()
        cache.restart()
        model(prompt, cache=cache)
    next(iter(cache.slots.values())).entry = None  # as if the prefill had not reached it
    assert not cache.refilled_in_place()


def test_a_fingerprint_that_fails_costs_the_reuse_not_the_tokens(monkeypatch):
    from hydra_model import decoder_hold

    model = case_model("hydra_mor")
    prompt = random_tokens(1, 6, seed=97)
    want = model.generate(prompt, 8, decode="staged", keep_decoder=False)
    model.generate(prompt, 8, decode="staged")

    def broken(self):
        raise RuntimeError("no checksum here")

    monkeypatch.setattr(decoder_hold.Fingerprint, "sums", broken)
    with pytest.warns(UserWarning, match="keeps no decoder"):  # the take fails, then the keep
        got = model.generate(prompt, 8, decode="staged")
    assert torch.equal(got, want) and "fingerprint failed" in model.last_decode_report.not_reused
    assert model._decoder_hold.held is None


@pytest.mark.parametrize("mode", ["dynamic", "expert_choice", "static"])
def test_a_generation_leaves_the_routing_statistics_of_the_last_forward(mode):
    """Prefill and decode steps record no MoD/MoR statistics: sampling during training must not
    overwrite what the training step's forward recorded (MoE layers still record theirs). Such a
    forward takes no targets."""
    model = small_model(seed=7, **MODES[mode]).eval()
    with torch.no_grad():
        model(random_tokens(2, 12, seed=101))
    before = [
        (name, b.clone()) for name, b in model.named_buffers() if ".stat_mod" in name or "stat_depth" in name
    ]
    assert before
    model.generate(random_tokens(1, 6, seed=102), 6, decode="staged")
    model.generate(random_tokens(1, 6, seed=103), 6, decode="eager")
    after = dict(model.named_buffers())
    for name, old in before:
        assert torch.equal(after[name], old), name
    with pytest.raises(ValueError, match="takes no targets"):
        ids = random_tokens(1, 6, seed=104)
        model(ids, targets=ids, cache=ModelCache(capacity=8))


def test_the_fingerprint_walk_finds_what_the_three_walks_found():
    """decoder_hold's one walk against named_buffers / parameters / named_modules with hasattr, on
    HYDRA and on modules made to trip it: a buffer shared under a stat_ name first, a parameter
    shared by two modules, a module answering ``mode`` from its own __getattr__, a property that
    raises AttributeError, a submodule named ``rule``."""
    from hydra_model import decoder_hold

    def old_walk(model):
        buffers = [b for name, b in model.named_buffers() if not name.rsplit(".", 1)[-1].startswith("stat_")]
        tensors = [t for t in (*model.parameters(), *buffers) if t.numel()]
        rules = tuple(
            (name, getattr(m, "static", None), getattr(m, "rule", None), getattr(m, "mode", None))
            for name, m in model.named_modules()
            if hasattr(m, "static") or hasattr(m, "rule") or hasattr(m, "mode")
        )
        return tensors, rules

    class Answers(torch.nn.Module):
        def __getattr__(self, name):
            if name == "mode":
                return "answered"
            return super().__getattr__(name)

    class Raises(torch.nn.Module):
        @property
        def static(self):
            raise AttributeError("not set")

    shared = torch.randn(3)
    a, b = torch.nn.Module(), torch.nn.Module()
    a.register_buffer("stat_x", shared)
    b.register_buffer("kept", shared)
    lin = torch.nn.Linear(4, 4)
    holder = torch.nn.Module()
    holder.rule = torch.nn.Identity()
    tricky = torch.nn.ModuleDict({"a": a, "b": b, "l1": lin, "l2": lin, "ans": Answers(), "raises": Raises(),
                                  "holder": holder})  # fmt: skip
    for model in (small_model().eval(), tricky):
        tensors, rules = decoder_hold._walk(model)
        want_tensors, want_rules = old_walk(model)
        assert [id(t) for t in tensors] == [id(t) for t in want_tensors]
        assert rules == want_rules


def _prefill_and_steps(model, cache, prompt, steps):
    vocab = model.config.vocab_size
    out = [model(prompt, cache=cache).logits]
    for i in range(steps):
        out.append(model(random_tokens(prompt.shape[0], 1, vocab, seed=200 + i), cache=cache).logits)
    return out


@pytest.mark.parametrize("name", ["hydra_mor", "hydra_mod", "gpt"])
def test_a_restarted_cache_takes_a_prompt_of_another_batch_size(name):
    """Restarted after a generation at batch 2, a cache prefills and decodes a batch of 3 as a
    new cache does (the kept position tensor had two rows: causal routing failed on it)."""
    model = case_model(name)
    vocab = model.config.vocab_size
    with torch.no_grad():
        cache = ModelCache(capacity=20)
        _prefill_and_steps(model, cache, random_tokens(2, 6, vocab, seed=21), 2)
        cache.restart()
        prompt = random_tokens(3, 7, vocab, seed=22)
        got = _prefill_and_steps(model, cache, prompt, 3)
        want = _prefill_and_steps(model, ModelCache(capacity=20), prompt, 3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", ["hydra_mor", "hydra_mod"])
def test_a_restarted_cache_of_a_cast_model_rebuilds_its_conv_weights(name):
    """After model.to(bf16) a restarted cache decodes as a new one: its conv bank held the
    weights folded from the fp32 parameters. An unchanged model keeps them (the same objects)."""
    model = case_model(name)
    vocab = model.config.vocab_size
    prompt = random_tokens(1, 6, vocab, seed=23)
    with torch.no_grad():
        cache = ModelCache(capacity=20)
        _prefill_and_steps(model, cache, prompt, 1)
        kept = dict(cache.conv_bank.weights)
        assert kept
        cache.restart()
        assert all(cache.conv_bank.weights[k] is w for k, w in kept.items())
        model.to(torch.bfloat16)
        cache.restart()
        assert not cache.conv_bank.weights
        got = _prefill_and_steps(model, cache, prompt, 2)
        want = _prefill_and_steps(model, ModelCache(capacity=20), prompt, 2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)
