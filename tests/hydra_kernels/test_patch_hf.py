"""patch() on stock transformers models: Llama, Mistral, Qwen2 and Qwen3 (tiny random configs).

Each patched model is compared with an unpatched copy of itself: the training loss (labels, with
ignored positions; the mean and the ``num_items_in_batch`` sum), every parameter's gradient, and
the evaluation logits. The Triton kernels run (interpreted on the CPU; the suite sets
TRITON_INTERPRET=1), and the test checks that the fused paths were taken: RMSNorm, SwiGLU and
RoPE kernels by counting calls, the fused loss by the missing logits. ``record.undo()`` restores
the stock model, and a family whose head is not known to be plain is left alone with a reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hydra_kernels
from hydra_kernels import controls, patch, patch_fallback_counts
from hydra_kernels import patching_hf as hf_patch
from hydra_kernels.ops import rms_norm as rms_norm_ops
from hydra_kernels.ops import swiglu as swiglu_ops

from .conftest import NEEDS_TRITON

pytestmark = NEEDS_TRITON

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
    initializer_range=0.1,
)  # fmt: skip
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True, "rope_theta": 500.0}),
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {}),  # per-head q/k RMSNorms
}


def build(family: str, seed: int) -> nn.Module:
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).float()
    with torch.no_grad():  # norms and biases away from their initial 1 / 0
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.3 * torch.randn_like(p))
    return model.train()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    labels[1, 7] = -100
    return ids, labels


def loss_and_grads(model: nn.Module, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.fixture
def undo_after():
    records = []
    yield records.append
    for record in records:
        record.undo()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of the fused RMSNorm, SwiGLU and RoPE entry points the patched modules use."""
    calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(hydra_kernels.modules, "rms_norm", counting("rms_norm", rms_norm_ops.rms_norm))
    monkeypatch.setattr(hydra_kernels.patching, "swiglu", counting("swiglu", swiglu_ops.swiglu))
    monkeypatch.setattr(hf_patch, "rope", counting("rope", hf_patch.rope))
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_equals_the_stock_model(family, undo_after, kernel_calls, seed):
    stock = build(family, seed)
    patched = copy.deepcopy(stock)
    ids, labels = batch(seed)
    want, want_grads = loss_and_grads(stock, ids, labels)
    items = (labels[:, 1:] != -100).sum() + 3  # as a gradient-accumulating trainer passes it
    want_sum, _ = loss_and_grads(stock, ids, labels, num_items_in_batch=items)
    stock.eval()
    with torch.no_grad():
        want_logits = stock(input_ids=ids).logits
    stock.train()

    record = patch(patched)
    undo_after(record)
    layers = COMMON["num_hidden_layers"]
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert record.counts() == {"rms_norm": norms, "swiglu_mlp": layers, "rope": 1, "linear_cross_entropy": 1}
    assert len(patch(patched)) == 0  # idempotent

    got, got_grads = loss_and_grads(patched, ids, labels)
    assert got.logits is None  # the fused loss never built them
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    got_sum, _ = loss_and_grads(patched, ids, labels, num_items_in_batch=items)
    torch.testing.assert_close(got_sum.loss, want_sum.loss, rtol=1e-5, atol=1e-6)
    per_forward = {"rms_norm": norms, "swiglu": layers, "rope": 2 * layers}  # rope: q and k
    assert all(kernel_calls[k] >= 2 * v for k, v in per_forward.items()), kernel_calls

    patched.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, want_logits, rtol=1e-5, atol=1e-5)
    assert not any(controls.fallback_counts().values()), controls.fallback_counts()
    assert not patch_fallback_counts().get("rope"), patch_fallback_counts()


def test_undo_restores_the_stock_model(undo_after, seed):
    import transformers.models.llama.modeling_llama as modeling

    original_rope = modeling.apply_rotary_pos_emb
    model = build("llama", seed)
    classes = {n: type(m) for n, m in model.named_modules()}
    record = patch(model)
    undo_after(record)
    assert modeling.apply_rotary_pos_emb is not original_rope and "forward" in model.__dict__
    record.undo()
    assert modeling.apply_rotary_pos_emb is original_rope and "forward" not in model.__dict__
    assert {n: type(m) for n, m in model.named_modules()} == classes and len(record) == 0
    ids, labels = batch(seed)
    assert model(input_ids=ids, labels=labels).logits is not None  # the stock forward again


def test_generation_and_evaluation_keep_the_stock_forward(undo_after, seed):
    stock = build("qwen2", seed).eval()
    patched = copy.deepcopy(stock)
    undo_after(patch(patched))
    ids, labels = batch(seed)
    with torch.no_grad():
        got = patched(input_ids=ids, labels=labels)  # evaluation: logits and loss, as stock
        want = stock(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    prompt = ids[:1, :4]
    out = patched.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.tolist() == stock.generate(prompt, max_new_tokens=5, do_sample=False).tolist()


def test_a_family_without_a_known_plain_head_keeps_its_loss(undo_after, seed):
    model = build("llama", seed)
    model.config.model_type = "some_family"  # e.g. one that soft-caps its logits
    record = patch(model)
    undo_after(record)
    assert record.counts()["linear_cross_entropy"] == 0 and "forward" not in model.__dict__
    assert any("some_family" in why for _, why in record.skipped)
    assert record.counts()["swiglu_mlp"] == COMMON["num_hidden_layers"]  # the modules still are


# --- the generic path: modules with the same maths, whatever their class ------------------------


class CustomMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SwappedOrderMLP(CustomMLP):
    """Same names, but the activation on the up projection: different maths."""

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act(self.up_proj(x)))


def test_generic_swiglu_mlps_are_found_by_what_they_compute(undo_after, seed):
    dim, hidden = 24, 40
    model = nn.ModuleDict(
        {
            "silu": CustomMLP(dim, hidden, nn.SiLU()),
            "gelu": CustomMLP(dim, hidden, nn.GELU()),
            "swapped": SwappedOrderMLP(dim, hidden, nn.SiLU()),
        }
    )
    hooked = CustomMLP(dim, hidden, nn.SiLU())
    hooked.register_forward_hook(lambda *a: None)
    model["hooked"] = hooked
    x = torch.randn(5, dim, requires_grad=True)
    want = model["silu"](x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    weights = dict(model["silu"].named_parameters())
    record = patch(model)
    undo_after(record)
    assert [(r.where, r.original, r.kind) for r in record] == [("silu", "CustomMLP", "swiglu_mlp")]
    assert dict(model["silu"].named_parameters()) == weights  # the same Parameters, same names
    got = model["silu"](x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    for name in ("gelu", "swapped", "hooked"):
        assert isinstance(model[name], CustomMLP)


def test_patched_rope_hands_other_calls_to_the_original(undo_after, seed):
    import transformers.models.llama.modeling_llama as modeling

    original = modeling.apply_rotary_pos_emb
    undo_after(patch(build("llama", seed)))
    fused = modeling.apply_rotary_pos_emb
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    angles = torch.rand(2, 6, 8) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    for got, want in zip(fused(q, k, cos, sin), original(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    before = patch_fallback_counts().get("rope", 0)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # the [B, S, H, D] layout: unsqueeze_dim=2
    with pytest.warns(RuntimeWarning, match="rope") if before == 0 else _no_warning():
        got = fused(qt, kt, cos, sin, unsqueeze_dim=2)
    for g, w in zip(got, original(qt, kt, cos, sin, unsqueeze_dim=2), strict=True):
        torch.testing.assert_close(g, w)
    assert patch_fallback_counts()["rope"] == before + 1


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ZeroInitGeGLU(CustomMLP):
    """A GeGLU MLP (Gemma's maths under Llama's names) whose class no other test probes."""


def test_an_mlp_with_a_zero_projection_is_probed_for_what_it_computes(undo_after, seed):
    """A zero-initialised down projection (a common residual init) makes any MLP output zeros:
    the probe must decide by the maths, not by the module's current weights, or a GeGLU MLP
    becomes SwiGLU and computes something else once it trains."""
    dim, hidden = 24, 40
    mlp = ZeroInitGeGLU(dim, hidden, nn.GELU(approximate="tanh"))
    nn.init.zeros_(mlp.down_proj.weight)
    model = nn.ModuleDict({"mlp": mlp})
    record = patch(model)
    undo_after(record)
    assert record.counts()["swiglu_mlp"] == 0 and model["mlp"] is mlp
    with torch.no_grad():  # as after some training
        nn.init.normal_(mlp.down_proj.weight, std=0.2)
        x = torch.randn(5, dim)
        want = mlp.down_proj(nn.functional.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
        torch.testing.assert_close(model["mlp"](x), want)


class FunctionActMLP(nn.Module):
    """The activation a plain function chosen per instance (``act_fn``), not a child module."""

    def __init__(self, dim: int, hidden: int, act_fn) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_instances_of_one_class_with_other_activations_are_probed_apart(undo_after, seed):
    """A decision cached for the class must not carry over to an instance computing otherwise."""
    dim, hidden = 24, 40
    model = nn.ModuleDict(
        {"silu": FunctionActMLP(dim, hidden, F.silu), "mish": FunctionActMLP(dim, hidden, F.mish)}
    )
    x = torch.randn(5, dim)
    with torch.no_grad():
        want = model["mish"](x)
    record = patch(model)
    undo_after(record)
    assert [r.where for r in record.of_kind("swiglu_mlp")] == ["silu"]
    with torch.no_grad():
        torch.testing.assert_close(model["mish"](x), want)
