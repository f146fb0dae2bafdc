"""HydraRMSNorm and patch()'s RMSNorm part: drop-in replacement decided by a numerical probe
(the other kinds on stock transformers models: test_patch_hf.py)."""

import os

import pytest
import torch
from torch import nn

from hydra_kernels import HydraRMSNorm, controls, patch
from hydra_kernels.ops.rms_norm import rms_norm_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_RUN_HERE = controls.device_supports_triton(DEVICE)


@pytest.fixture(autouse=True)
def _seeded():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    controls.reset_fallback_counts()
    return seed


class LlamaStyleRMSNorm(nn.Module):
    """The Hugging Face Llama formulation: fp32 statistics, weight applied in the input dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden):
        dtype = hidden.dtype
        h = hidden.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class GemmaStyleRMSNorm(nn.Module):
    """Scales by (1 + w): different math, must not be swapped."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)).to(
            x.dtype
        )


class HardcodedEpsRMSNorm(LlamaStyleRMSNorm):
    """Claims eps 1e-6 but computes with 1e-3: the probe's small rows must catch it."""

    def forward(self, hidden):
        h = hidden.float()
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-3)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp_norm = LlamaStyleRMSNorm(dim)
        self.gemma_norm = GemmaStyleRMSNorm(dim)
        self.layer_norm = nn.LayerNorm(dim)
        self.bad_eps_norm = HardcodedEpsRMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        x = self.proj(self.attn_norm(x))
        return self.layer_norm(self.gemma_norm(self.mlp_norm(self.bad_eps_norm(x))))


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.final_norm = nn.RMSNorm(dim, elementwise_affine=False)  # eps None: finfo eps

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)


def pairs(record):
    """(qualified name, original class) of every RMSNorm replacement in a PatchRecord."""
    assert all(r.kind == "rms_norm" for r in record)
    return sorted((r.where, r.original) for r in record)


def _randomise(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


def test_patch_swaps_same_math_and_skips_the_rest():
    dim = 48
    model = Model(dim).to(DEVICE)
    _randomise(model)
    x = torch.randn(3, 5, dim, device=DEVICE)
    before = model(x).detach()
    weights = {n: m.weight for n, m in model.named_modules() if getattr(m, "weight", None) is not None}

    replaced = patch(model)

    assert pairs(replaced) == sorted(
        [
            ("blocks.0.attn_norm", "RMSNorm"),
            ("blocks.0.mlp_norm", "LlamaStyleRMSNorm"),
            ("blocks.1.attn_norm", "RMSNorm"),
            ("blocks.1.mlp_norm", "LlamaStyleRMSNorm"),
            ("final_norm", "RMSNorm"),
        ]
    )
    for name, _ in pairs(replaced):
        module = model.get_submodule(name)
        assert isinstance(module, HydraRMSNorm)
        if name in weights:
            assert module.weight is weights[name]  # the same Parameter object, not a copy
    for b in model.blocks:  # different math or extra state: untouched
        assert type(b.gemma_norm) is GemmaStyleRMSNorm
        assert type(b.layer_norm) is nn.LayerNorm
        assert type(b.bad_eps_norm) is HardcodedEpsRMSNorm
    assert model.blocks[0].attn_norm.eps == 1e-5 and model.final_norm.eps is None
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert patch(model) == []  # idempotent


def test_patched_weight_trains_through_the_kernel():
    dim = 40
    model = nn.Sequential(nn.Linear(dim, dim), LlamaStyleRMSNorm(dim)).to(DEVICE)
    _randomise(model)
    reference = nn.Sequential(nn.Linear(dim, dim), LlamaStyleRMSNorm(dim)).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    norm_weight = model[1].weight
    assert pairs(patch(model)) == [("1", "LlamaStyleRMSNorm")]
    x = torch.randn(7, dim, device=DEVICE)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert norm_weight.grad is not None and model[1].weight is norm_weight
    torch.testing.assert_close(norm_weight.grad, reference[1].weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=1e-4, atol=1e-4)
    if KERNELS_RUN_HERE:
        y = model[1](x)
        assert "RMSNorm" in type(y.grad_fn).__name__  # the fused path, not the reference
    assert controls.fallback_counts()["rms_norm"] == 0


def test_shared_module_is_replaced_everywhere():
    norm = nn.RMSNorm(16)
    model = nn.ModuleDict({"a": norm, "b": nn.Sequential(norm)})
    replaced = patch(model)
    assert pairs(replaced) == [("a", "RMSNorm"), ("b.0", "RMSNorm")]
    assert model["a"] is model["b"][0] and isinstance(model["a"], HydraRMSNorm)


def test_modules_with_hooks_or_extra_state_are_left_alone():
    hooked = nn.RMSNorm(16)
    hooked.register_forward_hook(lambda *a: None)
    multi_dim = nn.RMSNorm((4, 16))
    model = nn.Sequential(hooked, multi_dim)
    assert patch(model) == []
    root = nn.RMSNorm(16)
    assert patch(root) == []  # the root itself cannot be replaced in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hydra_rms_norm_module(dtype):
    dim = 72
    m = HydraRMSNorm(dim, eps=1e-5, device=DEVICE, dtype=torch.float32)
    with torch.no_grad():
        m.weight.add_(0.3 * torch.randn(dim, device=DEVICE))
    x = torch.randn(4, 9, dim, device=DEVICE).to(dtype).requires_grad_()
    y = m(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y, rms_norm_ref(x, m.weight, 1e-5))
    y.float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.dtype == torch.float32
    assert list(m.state_dict()) == ["weight"]
    assert "72, eps=1e-05" in repr(m)


def test_hydra_rms_norm_without_affine_matches_torch():
    m = HydraRMSNorm(24, eps=None, elementwise_affine=False, device=DEVICE)
    x = torch.randn(5, 24, device=DEVICE, requires_grad=True)
    expected = nn.RMSNorm(24, elementwise_affine=False).to(DEVICE)(x)
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-6)
    assert m.weight is None and list(m.state_dict()) == []
    (gx,) = torch.autograd.grad(m(x).sum(), x)
    (rx,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="dim must be positive"):
        HydraRMSNorm(0)
