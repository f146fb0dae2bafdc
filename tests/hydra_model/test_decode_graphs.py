"""Staged decoding (decode_graphs.py): the stages a graphed decoder captures compute what the
model's own decode step computes, skip routed blocks only for tokens routed out of them, and
change the cache only in place (what a replayed CUDA graph needs)."""

import collections

import pytest
import torch

from hydra_model import build_model
from hydra_model.cache import ModelCache
from hydra_model.conditional_graphs import conditional_nodes_fail
from hydra_model.decode_graphs import DecodeStage, StagedDecoder, resolve_mode, segments_of
from hydra_model.graph_compose import driver_conditional_fail

from .conftest import MODES, random_tokens, small_model

ROUTED = dict(n_mor_blocks=5, recursions_per_block=1, mod_capacity=0.5, mod_block_stride=2)


def routed_model(seed: int) -> torch.nn.Module:
    """A small HYDRA with two MoD-routed blocks whose routers take some tokens and not others."""
    torch.manual_seed(seed)
    model = build_model("hydra", "tiny", **ROUTED).eval()
    routed = [blk for blk in model.blocks if blk.routed]
    assert len(routed) == 2
    for blk in routed:
        torch.nn.init.normal_(blk.router.weight, std=1.0)
        blk.causal.threshold.tau.fill_(0.0)  # about half the tokens clear it
    return model


def branching_case(batch: int, new_tokens: int, tries: int = 8):
    """A routed model (fresh seed) and prompt [batch, 6] whose greedy staged decoding both runs and
    skips a routed block; most seeds do, a few repeat one token and route it alike every step (at
    batch > 1 a block is skipped only when no row takes it: runs are required there, not skips)."""
    for _ in range(tries):
        seed = torch.seed() % 2**31
        model = routed_model(seed=seed)
        prompt = torch.randint(0, model.config.vocab_size, (batch, 6))
        model.generate(prompt, new_tokens, decode="staged")
        report = model.last_decode_report
        if report.gated_run > 0 and (report.gated_skipped > 0 or batch > 1):
            return model, prompt
    pytest.fail(f"no seed of {tries} gave a decoding that both runs and skips a routed block")


def test_staged_steps_equal_the_models_decode_step_and_skip_routed_blocks():
    model = routed_model(seed=torch.seed() % 2**31)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 9))
    ref_cache, cache = ModelCache(capacity=40), ModelCache(capacity=40)
    with torch.no_grad():
        ref_logits = model(prompt, cache=ref_cache).logits[:, -1]
        logits = model(prompt, cache=cache).logits[:, -1]
        decoder = StagedDecoder(model, cache, 1, prompt.device, "staged")
        for _ in range(24):
            nxt = torch.randint(0, vocab, (1,))  # the same tokens for both: not a greedy echo
            ref_logits = model(nxt.view(1, 1), cache=ref_cache).logits[:, -1]
            logits = decoder.step(nxt)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    report = decoder.report
    assert report.segments == 5 and report.gated_segments == 2 and report.steps == 24
    assert report.gated_run > 0 and report.gated_skipped > 0  # both branches were exercised
    assert report.gated_run + report.gated_skipped == 2 * 24
    assert cache.seq_len == ref_cache.seq_len == 9 + 24
    for key, slot in ref_cache.slots.items():
        torch.testing.assert_close(cache.slots[key].entry.length, slot.entry.length, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("batch", [1, 3])
def test_staged_generation_gives_the_eager_tokens(arch, batch):
    model = routed_model(seed=torch.seed() % 2**31) if arch == "hydra" else build_model("gpt", "tiny").eval()
    prompt = torch.randint(0, model.config.vocab_size, (batch, 6))
    eager = model.generate(prompt, 16, decode="eager")
    assert model.last_decode_report.mode == "eager" and model.last_decode_report.steps == 15
    staged = model.generate(prompt, 16, decode="staged")
    assert model.last_decode_report.mode == "staged" and model.last_decode_report.steps == 15
    assert torch.equal(eager, staged)


@pytest.mark.parametrize("batch", [1, 3])
def test_masked_decoding_runs_every_block_and_keeps_the_tokens(batch, monkeypatch):
    """decode='masked' (the stages eagerly on the CPU, no host read): every routed block runs each
    step, yet the tokens equal eager decoding's and the taken/not-taken counts equal those the
    staged decoder reads on the host."""
    model, prompt = branching_case(batch, 20)
    eager = model.generate(prompt, 20, decode="eager")
    staged = model.generate(prompt, 20, decode="staged")
    host = model.last_decode_report
    calls = []
    for blk in model.blocks:
        if blk.routed:
            monkeypatch.setattr(blk.mor, "forward", _recording(blk.mor.forward, calls))
    masked = model.generate(prompt, 20, decode="masked")
    report = model.last_decode_report
    assert torch.equal(masked, eager) and torch.equal(staged, eager)
    assert report.mode == "masked" and report.steps == host.steps == 19
    assert (report.gated_run, report.gated_skipped) == (host.gated_run, host.gated_skipped)
    assert len(calls) == 2 * 19 + 2  # both routed blocks, every decode step, plus the prompt


def _recording(forward, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return wrapped


def decode_state(cache: ModelCache) -> list[torch.Tensor]:
    """Every tensor of the cache a decode step changes (the slots' masks and working rows too)."""
    state = [cache.position, *cache.counts.values()]
    for slot in cache.slots.values():
        e = slot.entry
        state += [e.k, e.v, e.length, e.bias]
        state += [t for t in (e.window, e.conv_state, e.prev_v) if t is not None]
    return state


def step_in_place(model, cache: ModelCache) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """Prefill 5 tokens of 2 sequences, decode one (it makes the position), then check that a
    second decode step changes ``decode_state`` only in place, and some of it; → (tensor, its
    address, its value) before that step."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        model(torch.randint(0, vocab, (2, 5)), cache=cache)
        model(torch.randint(0, vocab, (2, 1)), cache=cache)  # makes the position
        before = [(t, t.data_ptr(), t.clone()) for t in decode_state(cache)]
        model(torch.randint(0, vocab, (2, 1)), cache=cache)
    after = decode_state(cache)
    assert all(a is b for a, (b, _, _) in zip(after, before, strict=True))
    assert all(t.data_ptr() == ptr for t, ptr, _ in before)
    assert any(not torch.equal(t, old) for t, _, old in before)  # the step did change state
    return before


def test_decode_step_changes_the_cache_only_in_place():
    model = routed_model(seed=torch.seed() % 2**31)
    cache = ModelCache(capacity=20)
    step_in_place(model, cache)
    assert torch.equal(cache.position, torch.full((2, 1), 7))  # 5 prompt tokens + 2 decoded


def test_segments_group_plain_stages_up_to_each_decision():
    def noop() -> None:
        pass

    flag = torch.zeros((), dtype=torch.bool)
    stages = [
        DecodeStage(noop),
        DecodeStage(noop, flag=flag),
        DecodeStage(noop, gated=True),
        DecodeStage(noop),
    ]
    segs = segments_of(stages)
    shapes = [(len(s.stages), s.gated, s.flag is not None) for s in segs]
    assert shapes == [(2, False, True), (1, True, False), (1, False, False)]
    with pytest.raises(ValueError, match="gated decode stage must follow"):
        segments_of([DecodeStage(noop), DecodeStage(noop, gated=True)])


def test_decode_mode_is_checked():
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) == "eager"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_mode("graphs", cpu)
    with pytest.raises(ValueError, match="decode='fast'"):
        resolve_mode("fast", cpu)


def cuda_case(arch: str, batch: int):
    """A model and prompt [batch, 6] on the GPU, fp32: HYDRA's a branching case chosen on the CPU
    (the GPU's fp32 roundings could move a decision sitting on the threshold), the tiny GPT's."""
    if arch == "hydra":
        model, prompt = branching_case(batch, 24)
    else:
        model = build_model("gpt", "tiny").eval()
        prompt = torch.randint(0, model.config.vocab_size, (batch, 6))
    return model.cuda(), prompt.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decoding_replays_the_eager_steps_on_cuda(arch, batch):
    """fp32 on the GPU: graphed greedy decoding gives the eager tokens, captured without a
    fallback, and (HYDRA) both runs and skips of the routed blocks happen."""
    model, prompt = cuda_case(arch, batch)
    eager = model.generate(prompt, 24, decode="eager")
    graphed = model.generate(prompt, 24, decode="graphs")
    report = model.last_decode_report
    assert report.mode == "graphs", report
    failed = conditional_nodes_fail(prompt.device)
    composed_failed = driver_conditional_fail(prompt.device)
    if arch == "gpt" or failed is None or composed_failed is None:
        # one replay a step (HYDRA: the routed blocks under conditional nodes, skipped by the GPU)
        assert report.reason is None and report.capture == "one graph", report
    else:  # conditional nodes missing or broken: a graph per segment, and the report says why
        assert report.capture == "per segment" and composed_failed in report.reason
    assert torch.equal(eager, graphed)
    if arch == "hydra":
        assert report.gated_segments == 2 and report.gated_run > 0
        if batch == 1:
            assert report.gated_skipped > 0
        # the runs and skips the GPU counted equal those the staged steps read on the host
        staged = model.generate(prompt, 24, decode="staged")
        counted = model.last_decode_report
        assert torch.equal(staged, eager)
        assert (counted.gated_run, counted.gated_skipped) == (report.gated_run, report.gated_skipped)
    # masked: one plain graph on any torch, every routed block run and its update masked
    masked = model.generate(prompt, 24, decode="masked")
    report = model.last_decode_report
    assert report.mode == "masked" and report.capture == "one graph" and report.reason is None, report
    assert torch.equal(masked, eager)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("arch", ["hydra", "gpt"])
def test_graphed_decoding_on_a_second_gpu_replays_the_eager_steps(arch):
    """A model on cuda:1 while cuda:0 is current, after a capture on cuda:0 in the same process:
    torch's own default capture stream lives on cuda:0 then (with it, HYDRA's one-graph capture
    failed and neither model's decoder could be kept). Graphed, masked and kept decoding give the
    eager tokens, the kept decoder is reused, and the caller's device stays current."""
    torch.cuda.set_device(0)
    first, prompt0 = cuda_case(arch, 1)
    first.generate(prompt0, 4, decode="graphs")  # a capture on cuda:0 first
    model, prompt = cuda_case(arch, 3)
    model, prompt = model.to("cuda:1"), prompt.to("cuda:1")
    eager = model.generate(prompt, 24, decode="eager")
    for mode in ("masked", "graphs", "graphs"):  # the second graphs call replays the kept decoder
        tokens = model.generate(prompt, 24, decode=mode)
        assert model.last_decode_report.mode == mode, model.last_decode_report
        assert torch.equal(tokens, eager), mode
    assert model.last_decode_report.reused
    assert torch.cuda.current_device() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_kept_graphed_decoder_replays_another_prompt_on_cuda(arch, batch):
    """The graphs captured for one generation replay the next (another prompt and length, the
    same total; decoder_hold.py): no capture, the eager tokens, and the routed blocks' runs and
    skips counted on the GPU equal those the staged steps read on the host."""
    model, prompt = cuda_case(arch, batch)
    other = torch.randint(0, model.config.vocab_size, (batch, 9), device=prompt.device)
    want = model.generate(other, 21, decode="eager")
    model.generate(prompt, 24, decode="graphs")
    first = model.last_decode_report
    got = model.generate(other, 21, decode="graphs")
    report = model.last_decode_report
    assert not first.reused and report.reused, report
    assert report.capture == first.capture and report.capture_ms == 0.0
    assert torch.equal(got, want)
    staged = model.generate(other, 21, decode="staged")
    counted = model.last_decode_report
    assert torch.equal(staged, want)
    assert (counted.gated_run, counted.gated_skipped) == (report.gated_run, report.gated_skipped)
    # a prompt length seen before: its prefill is captured, then replayed, for any prompt of it
    third = torch.randint(0, model.config.vocab_size, (batch, 9), device=prompt.device)
    want_third = model.generate(third, 21, decode="eager")
    model.generate(prompt, 24, decode="graphs")  # held again (a new decoder: after staged)
    runs = ((other, want, "eager"), (third, want_third, "graph captured"), (other, want, "graph"))
    for ids, expect, how in runs:
        got = model.generate(ids, 21, decode="graphs")
        report = model.last_decode_report
        assert report.reused and report.prefill == how and torch.equal(got, expect), report
    # a weight changed behind the graphs' back (no version bump): the fingerprint graph sees it
    with torch.no_grad():
        model.embed.weight.data[3, 0] += 1.0
    model.generate(other, 21, decode="graphs")
    assert not model.last_decode_report.reused and "changed" in model.last_decode_report.not_reused


def test_a_decode_step_gathers_its_rotary_tables_in_its_first_stage(monkeypatch):
    """A replayed graph runs only what was captured: rotary tables gathered inside a routed block's
    (skippable) stage would be stale for every block after it whenever that block is skipped. So
    the step's one gather sits in the embedding stage, which every step runs; here block 0 is
    routed, the case that would expose it."""
    torch.manual_seed(0)
    model = build_model(
        "hydra", "tiny", n_mor_blocks=3, recursions_per_block=1, mod_capacity=0.5,
        mod_block_stride=1, mod_dense_first_last=False,
    ).eval()  # fmt: skip
    assert model.blocks[0].routed
    cache = ModelCache(capacity=16)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 5)), cache=cache)
        decoder = StagedDecoder(model, cache, 1, torch.device("cpu"), "staged")
        decoder.step(torch.tensor([3]))
        gathered, segment = [], [None]
        tables = model.rope.tables
        monkeypatch.setattr(
            model.rope, "tables", lambda *a, **k: gathered.append(segment[0]) or tables(*a, **k)
        )
        for i, seg in enumerate(decoder.segments):  # every stage, gated ones too
            segment[0] = i
            for stage in seg.stages:
                stage.run()
    assert decoder.segments[1].gated and gathered == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused decode kernels run on a GPU here")
@pytest.mark.parametrize("arch", ["hydra", "gpt"])
@pytest.mark.parametrize("decode_conv", ["headwise", "window_gemm", "window_tiles"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_kernels_on_cuda_give_the_reference_tokens(arch, decode_conv, batch, monkeypatch):
    """fp32 on the GPU with hydra_kernels' Triton kernels on: graphed decoding (the one-kernel
    routing decision, the fused attention step kernel) gives the tokens of eager decoding with
    every kernel off (PyTorch ops), and no fused kernel fell back to its reference."""
    import hydra_kernels
    import hydra_kernels.ops.kv_decode as kv_mod
    import hydra_kernels.ops.router_decide as rd_mod
    import hydra_kernels.ops.tile_linear as tile_mod
    from hydra_model.options import OPTIONS

    if arch == "gpt" and decode_conv != "headwise":
        pytest.skip("the GPT has no convs")
    monkeypatch.setattr(OPTIONS, "decode_conv", decode_conv)
    model, prompt = cuda_case(arch, batch)
    reference = model.generate(prompt, 24, decode="eager")  # the conftest keeps the kernels off
    fallbacks = hydra_kernels.fallback_counts()
    launches = collections.Counter()
    kernels = [(kv_mod, "kv_decode_step_launch"), (rd_mod, "router_decide_launch")]
    if decode_conv == "window_tiles":
        kernels.append((tile_mod, "tile_linear_launch"))
    for mod, name in kernels:
        launch = getattr(mod, name)

        def counted(*a, _launch=launch, _name=name, **k):
            launches.update([_name])
            return _launch(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    hydra_kernels.set_use_triton_kernels(True)
    graphed = model.generate(prompt, 24, decode="graphs")
    report = model.last_decode_report
    assert report.mode == "graphs" and report.capture == "one graph", report
    assert torch.equal(graphed, reference)
    assert fallbacks == hydra_kernels.fallback_counts()
    assert launches["kv_decode_step_launch"] > 0  # the fused kernels ran (captured in the warm-up)
    assert launches["router_decide_launch"] > 0 or arch == "gpt"
    assert launches["tile_linear_launch"] > 0 or decode_conv != "window_tiles"


def test_a_generation_that_fails_still_reports_its_routing_decisions(monkeypatch):
    """The decisions a masked decoder counts on the device reach the report even when a later step
    raises (generate's ``finally``)."""
    model, prompt = branching_case(1, 12)
    real_step, calls = StagedDecoder.step, []

    def step_then_fail(self, tokens):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("a step failed")
        return real_step(self, tokens)

    monkeypatch.setattr(StagedDecoder, "step", step_then_fail)
    with pytest.raises(RuntimeError, match="a step failed"):
        model.generate(prompt, 12, decode="masked")  # on a CPU: the stages, counted on the device
    report = model.last_decode_report
    assert report.steps == 5 and report.gated_run + report.gated_skipped == 2 * 5


@pytest.mark.parametrize("mode", [*MODES, "capacity_1"])
def test_staged_decoding_with_one_recursion_gives_the_eager_tokens(mode):
    """One recursion a block (the 100M preset's layout: no MoR gate) in every routing mode: a decode
    stage adds a block's update to the stream in place only where nothing reads the block's input
    again (a soft gate, a gathered copy, a gated stage would see the updated stream instead)."""
    overrides = {"mod_capacity": 1.0} if mode == "capacity_1" else MODES[mode]
    model = small_model(seed=5, recursions_per_block=1, **overrides).eval()
    prompt = random_tokens(2, 6)
    eager = model.generate(prompt, 12, decode="eager")
    staged = model.generate(prompt, 12, decode="staged")
    assert torch.equal(eager, staged)


def test_the_decision_flags_are_slots_of_one_vector_tallied_once_a_step():
    """Each routed block's flag is a slot of the decoder's flag vector, so a step tallies all its
    decisions with one kernel; the tally per slot equals the host's reading of each flag."""
    model = routed_model(seed=torch.seed() % 2**31)
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    cache = ModelCache(capacity=30)
    with torch.no_grad():
        model(prompt, cache=cache)
        decoder = StagedDecoder(model, cache, 1, prompt.device, "masked")
        flags = [seg.flag for seg in decoder.segments if seg.flag is not None]
        assert decoder._pooled and len(flags) == 2
        assert [f.data_ptr() for f in flags] == [decoder._flags[i].data_ptr() for i in range(2)]
        host = torch.zeros(2, dtype=torch.long)
        for _ in range(12):
            decoder.step(torch.randint(0, model.config.vocab_size, (1,)))
            host += torch.stack([f.long() for f in flags])  # this step's decisions, read after it
    assert torch.equal(decoder._taken[:2], host) and not decoder._taken[2:].any()
    report = decoder.finish()
    assert report.gated_run == int(host.sum()) and report.gated_skipped == 2 * 12 - int(host.sum())
