"""Edge inputs of the public op API that a user can pass: what the references accept, scalar
arguments of other Python types, and the modules' drop-in promises. Fresh random inputs each run;
each expectation is a hand computation in float64 or a property of the documented behaviour."""

import warnings

import pytest
import torch
from torch import nn

from hydra_kernels import (
    HydraRMSNorm,
    controls,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    qk_norm,
    qk_norm_rope,
    reset_linear_ce_options,
    rms_norm,
    rms_norm_ref,
    set_linear_ce_options,
)

from .conftest import DEVICE, NEEDS_TRITON


def _ce_by_hand(hidden, weight, targets, ignore_index, reduction, z_loss):
    """Per-token loss in float64 over flattened tokens, from logsumexp and the target's logit."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).double()
    logits = h @ weight.detach().double().t()
    y = targets.reshape(-1).long()
    valid = y != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    loss = torch.where(valid, lse - picked + z_loss * lse * lse, 0.0)
    if reduction == "none":
        return loss.reshape(targets.shape)
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum().clamp_min(1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("seq", [5, 11])  # 11 == V: [B, S, V] logits fit cross_entropy's [N, C, d]
def test_linear_ce_ref_takes_batched_hidden(reduction, seq, seed):
    b, d, v = 2, 8, 11
    hidden = torch.randn(b, seq, d, dtype=torch.float64, device=DEVICE)
    weight = torch.randn(v, d, dtype=torch.float64, device=DEVICE)
    targets = torch.randint(0, v, (b, seq), device=DEVICE)
    targets[0, 1] = -100
    got = linear_cross_entropy_ref(hidden, weight, targets, -100, reduction, 1e-3)
    want = _ce_by_hand(hidden, weight, targets, -100, reduction, 1e-3)
    assert got.shape == want.shape, f"seed={seed}"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed={seed}")
    # and the op itself agrees with its reference on the same batched call
    op = linear_cross_entropy(hidden, weight, targets, -100, reduction, 1e-3)
    torch.testing.assert_close(op, want, rtol=1e-10, atol=1e-10, msg=f"seed={seed}")


def test_linear_ce_ref_takes_the_ops_target_and_weight_dtypes(seed):
    n, d, v = 9, 8, 13
    hidden = torch.randn(n, d, device=DEVICE)
    weight = torch.randn(v, d, device=DEVICE)
    targets = torch.randint(0, v, (n,), device=DEVICE)
    want = _ce_by_hand(hidden, weight, targets, -100, "mean", 0.0)
    for narrow in (torch.int32, torch.int16, torch.uint8):
        got = linear_cross_entropy_ref(hidden, weight, targets.to(narrow))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"{narrow} seed={seed}")
    # a bf16 hidden with an fp32 weight: the matmul runs in hidden's dtype, as the op's does
    hb = hidden.bfloat16()
    got = linear_cross_entropy_ref(hb, weight, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, linear_cross_entropy_ref(hb, weight.bfloat16(), targets), rtol=0, atol=0)


def _rms_by_hand(x, w, eps):
    xd = x.detach().double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.detach().double()


@NEEDS_TRITON
@pytest.mark.parametrize("kind", ["tensor", "int"])
def test_rms_norm_eps_of_another_scalar_type_runs_the_kernel(kind, seed):
    x = torch.randn(6, 40, device=DEVICE, requires_grad=True)
    w = (1 + 0.3 * torch.randn(40, device=DEVICE)).requires_grad_()
    r = torch.randn(6, 40, device=DEVICE)
    eps = torch.tensor(0.25) if kind == "tensor" else 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel failure would warn (and count a fallback)
        y = rms_norm(x, w, eps)
        normed, summed = fused_add_rms_norm(x, r, w, eps)
        y.sum().backward()
    assert not any(controls.fallback_counts().values()), controls.fallback_counts()
    torch.testing.assert_close(y.double(), _rms_by_hand(x, w, float(eps)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed.double(), _rms_by_hand(x + r, w, float(eps)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, x + r)


@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm"])
def test_rms_norm_bad_eps_and_scalar_x_name_the_argument(fn):
    x, w = torch.randn(3, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    call = {
        "rms_norm": lambda x, eps: rms_norm(x, w, eps),
        "fused_add_rms_norm": lambda x, eps: fused_add_rms_norm(x, x, w, eps),
    }[fn]
    for bad in (None, "1e-6", torch.ones(2)):
        with pytest.raises(TypeError, match="eps"):
            call(x, bad)
    with pytest.raises(ValueError, match=r"x .*at least one dim"):
        call(torch.tensor(1.0, device=DEVICE), 1e-6)
    # the references stay what they were for well-formed calls
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    torch.testing.assert_close(fused_add_rms_norm(x, x, w)[0], fused_add_rms_norm_ref(x, x, w)[0])


def test_hydra_rms_norm_takes_torch_rmsnorm_normalized_shape(seed):
    x = torch.randn(4, 3, 16, device=DEVICE, requires_grad=True)
    for shape in ([16], (16,), torch.Size([16])):
        ours = HydraRMSNorm(shape, eps=1e-5, device=DEVICE)
        theirs = nn.RMSNorm(shape, eps=1e-5, device=DEVICE)
        with torch.no_grad():
            theirs.weight.normal_()
            ours.weight.copy_(theirs.weight)
        assert ours.normalized_shape == theirs.normalized_shape
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5, msg=f"{shape} seed={seed}")
    with pytest.raises(ValueError, match="normalized_shape"):
        HydraRMSNorm((3, 16))
    with pytest.raises(ValueError, match="dim must be positive"):
        HydraRMSNorm([0])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_unavailable_cublas_backend_is_a_clear_error_not_a_kernel_fault(reduction):
    """dw_backend='cublas' where torch cannot add a 16-bit chunk product into the fp32 dW (the
    CPU; old torch builds): a ValueError naming the option, no kernel fallback counted."""
    if torch.cuda.is_available():
        pytest.skip("the fp32-out cuBLAS GEMM may exist here")
    set_linear_ce_options(dw_backend="cublas")
    try:
        hidden = torch.randn(7, 8, device=DEVICE).bfloat16().requires_grad_()
        weight = torch.randn(13, 8, device=DEVICE, requires_grad=True)  # fp32: dW in fp32
        targets = torch.randint(0, 13, (7,), device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=r"dw_backend='cublas'.*dw_backend='auto'"):
                linear_cross_entropy(hidden, weight, targets, reduction=reduction).sum().backward()
            # one dtype throughout needs no fp32-out GEMM: the option is fine there
            h32 = hidden.detach().float().requires_grad_()
            loss = linear_cross_entropy(h32, weight, targets, reduction=reduction)
            want = _ce_by_hand(h32, weight, targets, -100, reduction, 0.0)
            torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
            loss.sum().backward()
    finally:
        reset_linear_ce_options()
    assert not any(controls.fallback_counts().values()), controls.fallback_counts()


@pytest.mark.parametrize("fn", ["qk_norm", "qk_norm_rope"])
def test_qk_norm_learnable_scale_is_refused_not_silently_frozen(fn, seed):
    """A scale tensor that requires grad was turned into a float: the call ran, and the scale
    never got a gradient. It is refused with what to do instead; the suggested form (the scale
    multiplied outside) gets the gradient of the hand-computed normalised heads."""
    x = torch.randn(2, 5, 3, 16, device=DEVICE)
    angles = torch.randn(5, 4, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()
    call = {
        "qk_norm": lambda x, s: qk_norm(x, s),
        "qk_norm_rope": lambda x, s: qk_norm_rope(x, s, None, cos, sin),
    }[fn]
    scale = torch.tensor(2.5, device=DEVICE, requires_grad=True)
    with pytest.raises(TypeError, match=r"scale.*requires grad.*\* scale"):
        call(x, scale)
    c = torch.randn(x.shape, device=DEVICE)
    (g,) = torch.autograd.grad((call(x, 1.0) * scale * c).sum(), scale)
    unit = x.double() / x.double().norm(dim=-1, keepdim=True)  # the head normalised by hand
    if fn == "qk_norm_rope":  # rotate-half on the first 8 channels, by hand
        c64, s64 = cos.double()[None, :, None, :], sin.double()[None, :, None, :]
        a, b = unit[..., :4], unit[..., 4:8]
        unit = torch.cat([a * c64 - b * s64, b * c64 + a * s64, unit[..., 8:]], dim=-1)
    want = float((unit * c.double()).sum())
    assert abs(float(g) - want) <= 1e-4 * (1 + abs(want)), f"seed={seed}: {float(g)} vs {want}"
    # a scale tensor without grad is a constant, as before
    torch.testing.assert_close(call(x, torch.tensor(2.5, device=DEVICE)), call(x, 2.5))
