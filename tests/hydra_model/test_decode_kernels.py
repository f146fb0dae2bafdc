"""A decode step's attention with hydra_kernels' Triton paths on (interpreted on the CPU): the fused
step kernel (hydra_kernels.ops.kv_decode: QK norm, RoPE, cache writes, mask, length, CCGQA's conv
window and value shift) gives the logits of the full forward and the tokens of eager decoding, for
the dense GPT and HYDRA (CCGQA, routed blocks whose tokens join or not, both decode conv forms);
it launches the few kernels it is meant to; and it changes the cache only in place."""

from __future__ import annotations

import collections

import pytest
import torch

import hydra_kernels
import hydra_kernels.ops.kv_decode as kv_mod
from hydra_kernels import controls
from hydra_kernels.launch_count import KernelCount
from hydra_model import CCGQAAttention, RotaryEmbedding, build_model
from hydra_model.cache import CacheSlot, ModelCache
from hydra_model.gqa import GQAAttention
from hydra_model.options import OPTIONS

from .test_decode_graphs import step_in_place

# these run the kernels on CPU tensors under Triton's interpreter (set by tests/conftest.py when
# there is no GPU); on a GPU machine the CUDA tests of test_decode_graphs.py run them for real
pytestmark = pytest.mark.skipif(
    not controls.device_supports_triton(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (no GPU)"
)

ROUTED = dict(n_mor_blocks=5, recursions_per_block=1, mod_capacity=0.5, mod_block_stride=2)


def make_model(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "gpt":
        return build_model("gpt", "tiny").eval()
    if arch == "gpt-ccgqa":
        return build_model("gpt", "tiny", attention="ccgqa").eval()
    model = build_model("hydra", "tiny", **ROUTED, routing_off=arch == "hydra-routing-off").eval()
    for blk in model.blocks:  # routers that take some tokens and not others
        if blk.routed:
            torch.nn.init.normal_(blk.router.weight, std=1.0)
            blk.causal.threshold.tau.fill_(0.0)
    return model


@pytest.mark.parametrize(
    ("arch", "conv"),
    [("gpt", "headwise"), ("gpt-ccgqa", "window_gemm"), ("hydra", "headwise"), ("hydra", "window_gemm"),
     ("hydra", "window_tiles"), ("hydra-routing-off", "headwise")],
)  # fmt: skip
def test_fused_decode_steps_equal_the_full_forward(arch, conv, monkeypatch):
    """fp32, batch 3: every decode step's logits equal the full forward's at that position, and
    staged greedy generation gives the eager tokens; the kernel ran, nothing fell back."""
    monkeypatch.setattr(OPTIONS, "decode_conv", conv)
    hydra_kernels.set_use_triton_kernels(True)
    model = make_model(arch, seed=torch.seed() % 2**31)
    vocab = model.config.vocab_size
    seq = torch.randint(0, vocab, (3, 14))
    fallbacks = hydra_kernels.fallback_counts()
    launches = []
    real_launch = kv_mod.kv_decode_step_launch
    monkeypatch.setattr(kv_mod, "kv_decode_step_launch", lambda *a: launches.append(1) or real_launch(*a))
    with torch.no_grad():
        full = model(seq).logits
        cache = ModelCache(capacity=16)
        model(seq[:, :6], cache=cache)
        for t in range(6, 14):
            step = model(seq[:, t : t + 1], cache=cache).logits[:, -1]
            torch.testing.assert_close(step, full[:, t], rtol=1e-4, atol=1e-4, msg=f"{arch} step {t}")
    assert launches and fallbacks == hydra_kernels.fallback_counts()
    prompt = seq[:, :5]
    eager = model.generate(prompt, 8, decode="eager")
    assert torch.equal(model.generate(prompt, 8, decode="staged"), eager)


def _decode_step_kernels(attn, slot, dim, rope, pos) -> collections.Counter:
    x = torch.randn(1, 1, dim)
    cos, sin = rope.tables(positions=torch.tensor([[pos]]))
    with torch.no_grad(), KernelCount() as counter:
        attn(x, cos, sin, slot=slot)
    return counter.kernels


@pytest.mark.parametrize("conv", ["headwise", "window_gemm", "window_tiles"])
def test_a_decode_step_launches_few_kernels(conv, monkeypatch):
    """At batch 1 a graphed step is bound by its launch count. GQA: the projection, the step
    kernel, attention, the output projection. CCGQA adds its conv stage: one GEMM over the window
    (window_gemm) or the head-wise batched GEMM with its copy and q-k mean (the conv op's
    reference: heads of 8 are not its kernels'; the mean's two halves joined by a cat, in place of
    a second add); no copy of the window, no mask build, no cast."""
    monkeypatch.setattr(OPTIONS, "decode_conv", conv)
    hydra_kernels.set_use_triton_kernels(True)
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 32)
    counts = {}
    for name, attn in (("gqa", GQAAttention(48, 6, 2, 8, 8)), ("ccgqa", CCGQAAttention(48, 6, 2, 8, 4))):
        if name == "ccgqa":
            rope = RotaryEmbedding(4, 32)
        slot = CacheSlot(12)
        with torch.no_grad():
            attn(torch.randn(1, 5, 48), *rope.tables(5), slot=slot)  # prefill
        _decode_step_kernels(attn, slot, 48, rope, 5)  # the first step builds the per-generation weights
        counts[name] = _decode_step_kernels(attn, slot, 48, rope, 6)
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert counts["gqa"] == {"mm": 2, "triton:_kv_decode_kernel": 1, sdpa: 1}
    headwise = {"clone": 1, "bmm": 1, "add": 3, "cat": 1, "mul": 1, "mean": 1}
    one_kernel = {"window_gemm": {"addmm": 1}, "window_tiles": {"triton:_tile_linear_kernel": 1}}
    conv_stage = one_kernel.get(conv, headwise)
    assert counts["ccgqa"] == {**counts["gqa"], **conv_stage}, counts["ccgqa"]


def test_a_prefill_launches_as_many_kernels_at_batch_three_as_at_one(monkeypatch):
    """The prefill's conv windows are a view of the window that tile_linear reads in place at any
    batch (a batch > 1 once copied them out first: a launch a CCGQA module), whose folded weights
    a new cache builds in one launch for all blocks; routed blocks, whose
    gathers and updates run per batch as well, launch no more for three sequences than for one."""
    monkeypatch.setattr(OPTIONS, "decode_conv", "window_tiles")
    hydra_kernels.set_use_triton_kernels(True)
    model = make_model("hydra", seed=int(torch.randint(0, 2**31, ()).item()))
    counts = {}
    for b in (1, 3):
        prompt = torch.randint(0, model.config.vocab_size, (b, 9))
        with torch.no_grad():
            model(prompt, cache=ModelCache(capacity=12))  # lazily built state
            with KernelCount() as count:
                model(prompt, cache=ModelCache(capacity=12))
        counts[b] = count.kernels
    assert counts[3] == counts[1], (counts[1], counts[3])
    assert counts[3]["triton:_tile_linear_kernel"] == len(model.blocks)  # one conv launch a block
    assert counts[3]["triton:_window_tiles_kernel"] == 1  # every block's conv weights, one launch


@pytest.mark.parametrize("arch", ["gpt", "hydra"])
def test_fused_decode_steps_change_the_cache_only_in_place(arch):
    hydra_kernels.set_use_triton_kernels(True)
    model = make_model(arch, seed=torch.seed() % 2**31)
    cache = ModelCache(capacity=12)
    before = step_in_place(model, cache)
    if arch == "gpt":  # every token joins every layer: each mask opened a key, each length advanced
        for t, _, old in before:
            if any(t is s.entry.bias or t is s.entry.length for s in cache.slots.values()):
                assert not torch.equal(t, old)


def test_the_routed_glue_kernels_give_the_op_by_op_bits():
    """HYDRA's no-grad glue as hydra_kernels' gated_update_, ccgqa_prefill and kv_prefill_
    (interpreted) against the same model with the three switched off (the op-by-op forms they
    replace), batch 3 with each sequence's own count of taken tokens: the eval forward's logits,
    the prefill's and every staged decode step's are the same bits, and each kernel ran (no
    fallback)."""
    hydra_kernels.set_use_triton_kernels(True)
    seed = torch.seed() % 2**31
    model = make_model("hydra", seed)
    seq = torch.randint(0, model.config.vocab_size, (3, 12))

    def run() -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            outs.append(model(seq).logits)
            cache = ModelCache(capacity=16)
            outs.append(model(seq[:, :8], cache=cache).logits)
            for t in range(8, 12):
                outs.append(model(seq[:, t : t + 1], cache=cache).logits)
            outs.append(model.generate(seq[:, :8], 4, decode="staged"))
        return outs

    with KernelCount() as fused:
        got = run()
    for op in ("gated_update", "ccgqa_prefill", "kv_prefill"):
        assert fused.kernels[f"triton:_{op}_kernel"] > 0, f"seed {seed}: {op} did not run"
        assert not controls.fallback_counts().get(op), f"seed {seed}: {op} fell back"
    controls.set_op_enabled("gated_update", False)
    controls.set_op_enabled("ccgqa_prefill", False)
    controls.set_op_enabled("kv_prefill", False)
    want = run()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"seed {seed}: output {i} differs by {(a.float() - b.float()).abs().max()}"
