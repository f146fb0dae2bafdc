"""Shared layers against fp64 hand computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hydra_model import RMSNorm, RotaryEmbedding, SwiGLUMLP


def test_rms_norm_matches_fp64_formula():
    torch.manual_seed(0)
    norm = RMSNorm(37, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37))
    x = torch.randn(3, 5, 37)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), ref, atol=1e-5, rtol=1e-5)
    r = torch.randn_like(x)
    torch.testing.assert_close(norm.forward_add(x, r), norm(x + r), atol=1e-6, rtol=1e-6)


def test_swiglu_mlp_matches_hand_computation():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(24, 40)
    x = torch.randn(2, 7, 24)
    w = mlp.w_gate_up.weight.double()
    gate, up = x.double() @ w[:40].t(), x.double() @ w[40:].t()
    ref = (F.silu(gate) * up) @ mlp.w_down.weight.double().t()
    torch.testing.assert_close(mlp(x).double(), ref, atol=1e-5, rtol=1e-5)


def test_rotary_tables_by_length_and_by_positions():
    rope = RotaryEmbedding(6, max_seq_len=11, base=500.0)
    cos, sin = rope.tables(9)
    assert cos.shape == (9, 3) and cos.dtype == torch.float32
    for t in (0, 4, 8):
        for i in range(3):
            angle = t * 500.0 ** (-2 * i / 6)
            assert math.isclose(cos[t, i].item(), math.cos(angle), abs_tol=1e-6)
            assert math.isclose(sin[t, i].item(), math.sin(angle), abs_tol=1e-6)
    pos = torch.tensor([[3, 0, 7], [10, 2, 2]])
    pc, ps = rope.tables(positions=pos)
    assert pc.shape == (2, 3, 3)
    full_c, full_s = rope.tables(11)
    torch.testing.assert_close(pc, full_c[pos])
    torch.testing.assert_close(ps, full_s[pos])


@pytest.mark.parametrize("rotary_dim", [0, 6, 16])  # none; sin's view off / on a 16-byte boundary
def test_rotary_tables_by_positions_read_one_gather_and_grow_with_the_table(rotary_dim):
    rope = RotaryEmbedding(rotary_dim, max_seq_len=5)
    rope.ensure(13)
    pos = torch.randint(0, 13, (3, 4))
    pc, ps = rope.tables(positions=pos)
    assert torch.equal(pc, rope.cos[pos]) and torch.equal(ps, rope.sin[pos])
    assert pc.stride() == ps.stride()  # the kernels take one stride set for both


def test_rotary_table_grows_and_stays_fp32():
    rope = RotaryEmbedding(4, max_seq_len=5)
    rope.ensure(13)
    assert rope.max_seq_len == 13
    rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32
    torch.testing.assert_close(rope.tables(13)[0][12, 0], torch.tensor(math.cos(12.0)), atol=1e-6, rtol=0)
    try:
        rope.tables(14)
    except ValueError as exc:
        assert "max_seq_len" in str(exc)
    else:
        raise AssertionError("a length beyond the table must raise")


def test_swiglu_down_recompute_matches_fp64_gradients():
    """The memory-saving SwiGLU → down-projection Function: values and gradients of both inputs
    against an fp64 autograd composition, on odd widths, and gradcheck in fp64."""
    from hydra_model.layers import _SwiGLUDown

    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(3, 5, 2 * 19, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 19, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(_SwiGLUDown.apply, (gate_up, w))
    x32, w32 = gate_up.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    out = _SwiGLUDown.apply(x32, w32)
    gu, wr = gate_up.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = (F.silu(gu[..., :19]) * gu[..., 19:]) @ wr.t()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(dy.float())
    ref.backward(dy)
    torch.testing.assert_close(x32.grad.double(), gu.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w32.grad.double(), wr.grad, atol=1e-5, rtol=1e-5)


def test_swiglu_mlp_uses_recompute_only_when_training():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(24, 40)
    x = torch.randn(2, 7, 24, requires_grad=True)
    out = mlp(x)
    assert type(out.grad_fn).__name__.startswith("_SwiGLUDown")
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), out.detach(), atol=1e-6, rtol=1e-6)
