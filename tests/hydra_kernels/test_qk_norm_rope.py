"""qk_norm_rope: the fused QK norm + RoPE kernels (interpreted on CPU) against the two unfused
ops (bitwise: the fused kernels round where they do) and against an fp64 reference.

Inputs are fresh random each run; the seed is in every failure message. The kernels are
qk_norm's: test_qk_norm.py compiles both variants for sm_90.
"""

import math
import warnings

import pytest
import torch

from hydra_kernels import controls, qk_norm, qk_norm_rope, rope
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import qk_norm_rope as fused_mod
from hydra_kernels.ops.qk_norm_rope import qk_norm_rope_backward_ref, qk_norm_rope_ref

from .conftest import DEVICE, NEEDS_TRITON

pytestmark = NEEDS_TRITON


def _tables(b, s, rot, per_sequence):
    angles = 3 * torch.randn(*((b, s) if per_sequence else (s,)), rot // 2, device=DEVICE)
    return angles.cos(), angles.sin()


def _grads(fn, x, temp, cos, sin, up, scale=5.0):
    y = fn(x, scale, temp, cos, sin)
    inputs = (x,) if temp is None else (x, temp)
    return (y, *torch.autograd.grad((y.double() * up.double()).sum(), inputs))


def _unfused(x, scale, temp, cos, sin):
    return rope(qk_norm(x, scale, temp), cos, sin)


@pytest.mark.parametrize(
    ("shape", "rot", "dtype", "with_temp", "per_sequence"),
    [
        ((2, 7, 3, 24), 16, torch.bfloat16, True, False),  # partial rotary, channels copied
        ((2, 5, 4, 32), 32, torch.bfloat16, True, True),  # full width, per-sequence positions
        ((1, 9, 2, 40), 8, torch.float32, False, True),  # head dim not a power of two
        ((3, 6, 2, 64), 64, torch.float16, True, False),
    ],
)
def test_fused_equals_qk_norm_then_rope_bitwise(shape, rot, dtype, with_temp, per_sequence, seed):
    """Output, dx and dtemperature bit for bit those of hydra_kernels' qk_norm then rope."""
    b, s, h, d = shape
    packed = torch.randn(b, s, h + 2, d, device=DEVICE).to(dtype)
    x = packed[:, :, 1 : 1 + h].detach().requires_grad_()  # a strided view, as q out of q|k
    assert not x.is_contiguous()
    temp = (0.3 * torch.randn(h, device=DEVICE)).requires_grad_() if with_temp else None
    cos, sin = _tables(b, s, rot, per_sequence)
    up = torch.randn(shape, device=DEVICE).to(dtype)
    fused = _grads(qk_norm_rope, x, temp, cos, sin, up)
    unfused = _grads(_unfused, x, temp, cos, sin, up)
    assert "QKNormRope" in type(fused[0].grad_fn).__name__, f"the fused op did not run: {fused[0].grad_fn}"
    assert len(fused) == len(unfused) == (3 if with_temp else 2)
    for name, f, u in zip(("y", "dx", "dtemperature"), fused, unfused, strict=False):
        diff = (f.double() - u.double()).abs().max()
        assert f.dtype == u.dtype and torch.equal(f, u), f"{name} (seed={seed}): max diff {diff}"
    assert controls.fallback_counts()["qk_norm_rope"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_fp64(dtype, seed):
    """Against float64: |fused − fp64| ≤ 2·|torch in dtype − fp64| + atol on the worst element
    (the op rounds the norm's output to the low precision, like the two ops it fuses)."""
    b, s, h, d, rot = 2, 6, 3, 48, 32
    x = torch.randn(b, s, h, d, device=DEVICE).to(dtype).requires_grad_()
    x.data[1, 2, 0] = 0.0  # an all-zero head: the norm's clamp holds
    temp = (0.3 * torch.randn(h, device=DEVICE)).requires_grad_()
    cos, sin = _tables(b, s, rot, True)
    up = torch.randn(x.shape, device=DEVICE).to(dtype)
    k = _grads(qk_norm_rope, x, temp, cos, sin, up)
    t = _grads(qk_norm_rope_ref, x, temp, cos, sin, up)
    x64, t64 = x.detach().double().requires_grad_(), temp.detach().double().requires_grad_()
    r = _grads(qk_norm_rope_ref, x64, t64, cos.double(), sin.double(), up)
    for name, kv, tv, rv in zip(("y", "dx", "dtemperature"), k, t, r, strict=True):
        res = check_against_fp64(kv, tv, rv, atol=fp32_noise_atol(rv), reduction="max")
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert not k[0][1, 2, 0].any()


def test_backward_reference_matches_autograd(seed):
    x = torch.randn(2, 5, 3, 40, dtype=torch.float64, device=DEVICE)
    temp = 0.3 * torch.randn(3, dtype=torch.float64, device=DEVICE)
    cos, sin = (t.double() for t in _tables(2, 5, 24, False))
    dy = torch.randn_like(x)
    dx, dtemp = qk_norm_rope_backward_ref(dy, x, 5.0, temp, cos, sin)
    x_, t_ = x.clone().requires_grad_(), temp.clone().requires_grad_()
    rx, rt = torch.autograd.grad(qk_norm_rope_ref(x_, 5.0, t_, cos, sin), (x_, t_), dy)
    torch.testing.assert_close(dx, rx, rtol=1e-10, atol=1e-10, msg=f"seed={seed}")
    torch.testing.assert_close(dtemp, rt, rtol=1e-10, atol=1e-10, msg=f"seed={seed}")


def test_switched_off_runs_the_two_ops(monkeypatch):
    def no_kernel(*args):
        raise AssertionError("the fused launcher ran although switched off")

    monkeypatch.setattr(fused_mod, "qk_norm_fwd_launch", no_kernel)
    monkeypatch.setattr(fused_mod, "qk_norm_bwd_launch", no_kernel)
    controls.set_op_enabled("qk_norm_rope", False)
    x = torch.randn(2, 3, 2, 16, device=DEVICE).requires_grad_()
    temp = torch.zeros(2, device=DEVICE, requires_grad=True)
    cos, sin = _tables(2, 3, 16, False)
    y = qk_norm_rope(x, 4.0, temp, cos, sin)
    assert "Rope" in type(y.grad_fn).__name__ and "QKNormRope" not in type(y.grad_fn).__name__
    torch.testing.assert_close(y, _unfused(x, 4.0, temp, cos, sin), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and temp.grad is not None


def test_tables_with_gradients_take_the_differentiable_path(seed):
    x = torch.randn(1, 4, 2, 16, device=DEVICE, requires_grad=True)
    angles = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    y = qk_norm_rope(x, 4.0, None, angles.cos(), angles.sin())
    (g,) = torch.autograd.grad(y.square().sum(), angles)
    x64, a64 = x.detach().double(), angles.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(qk_norm_rope_ref(x64, 4.0, None, a64.cos(), a64.sin()).square().sum(), a64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")
    assert controls.fallback_counts()["qk_norm_rope"] == 0


@pytest.mark.fallback_expected
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_kernel_failure_falls_back_counted_and_warned_once(stage, monkeypatch, seed):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    launcher = "qk_norm_fwd_launch" if stage == "forward" else "qk_norm_bwd_launch"
    monkeypatch.setattr(fused_mod, launcher, broken)
    x = torch.randn(2, 5, 3, 32, device=DEVICE).requires_grad_()
    temp = (0.3 * torch.randn(3, device=DEVICE)).requires_grad_()
    cos, sin = _tables(2, 5, 32, False)
    up = torch.randn(x.shape, device=DEVICE)
    want = _grads(_unfused, x, temp, cos, sin, up)
    with pytest.warns(RuntimeWarning, match="simulated kernel failure"):
        got = _grads(qk_norm_rope, x, temp, cos, sin, up)
    assert controls.fallback_counts()["qk_norm_rope"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grads(qk_norm_rope, x, temp, cos, sin, up)
    assert controls.fallback_counts()["qk_norm_rope"] == 2
    for g, w in zip(got, want, strict=True):  # the reference answers with the same values (fp32)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


def test_arguments_are_checked():
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="temperature has shape"):
        qk_norm_rope(torch.randn(2, 3, 4, 8), 1.0, torch.zeros(3), cos, sin)
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        qk_norm_rope(torch.randn(3, 4, 8), 1.0, None, cos, sin)
    with pytest.raises(ValueError, match="exceeds the head dim"):
        qk_norm_rope(torch.randn(2, 3, 4, 6), 1.0, None, cos, sin)


def test_custom_ops_pass_opcheck():
    x = torch.randn(2, 3, 2, 16, device=DEVICE, requires_grad=True)
    temp = torch.randn(2, device=DEVICE, requires_grad=True)
    cos, sin = _tables(2, 3, 8, True)
    torch.library.opcheck(fused_mod._fwd_op, (x, 4.0, temp, cos, sin))
    torch.library.opcheck(fused_mod._fwd_op, (x, 4.0, None, cos, sin))
    dy = torch.randn(x.shape, device=x.device)
    torch.library.opcheck(fused_mod._bwd_op, (dy, x.detach(), 4.0, temp.detach(), cos, sin))


def test_compiled_fullgraph_equals_eager(seed):
    import torch._dynamo

    x = torch.randn(2, 5, 3, 32, device=DEVICE, requires_grad=True)
    temp = (0.3 * torch.randn(3, device=DEVICE)).requires_grad_()
    cos, sin = _tables(2, 5, 16, False)
    torch._dynamo.reset()
    compiled = torch.compile(qk_norm_rope, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, qk_norm_rope):
        y = fn(x, math.sqrt(32), temp, cos, sin)
        results.append((y, *torch.autograd.grad(y.square().sum(), (x, temp))))
    for c, e in zip(*results, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0, msg=f"seed={seed}")  # the same kernels
    torch._dynamo.reset()


def test_the_custom_ops_refuse_tables_that_do_not_fit_x():
    """Called directly (as compiled code does), the ops check what the kernel would index: a
    rotary width past the head, or tables of another length, raise instead of reading past them."""
    x = torch.randn(1, 2, 2, 8, device=DEVICE)
    wide = torch.ones(2, 6, device=DEVICE)  # R = 12 > D = 8
    with pytest.raises(ValueError, match="exceeds the head dim"):
        fused_mod._fwd_op(x, 1.0, None, wide, wide)
    short = torch.ones(1, 4, device=DEVICE)  # S = 1, x has 2
    with pytest.raises(ValueError, match=r"\[S, R/2\]"):
        fused_mod._bwd_op(torch.randn_like(x), x, 1.0, None, short, short)
    assert controls.fallback_counts()["qk_norm_rope"] == 0
