"""Bad inputs to the public ops: each is refused with an error naming the argument, or (a layout the
op can take) computed right. Every case here failed before its check or fix: a torch error deep in
a reference or launcher that named no argument, a silently wrong result, or a kernel reading
memory the caller did not mean (on a GPU: an illegal memory access). Results are checked against
float64 computed by hand; inputs are fresh random each run."""

import warnings

import pytest
import torch

from hydra_kernels import fused_add_rms_norm, linear_cross_entropy
from hydra_kernels.ops.causal_select import causal_select, causal_select_ref
from hydra_kernels.ops.kv_prefill import kv_prefill_
from hydra_kernels.ops.tile_linear import pack_tiles, tile_linear

from .conftest import DEVICE, NEEDS_TRITON


def _no_fallback():
    """A context in which a kernel failure (which warns, and is counted) fails the test."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx


def _rms_by_hand(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.double()
    return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()


# --- fused_add_rms_norm: a residual that is not x's shape ---------------------------------------


def test_fused_add_residual_that_does_not_fit_x_names_residual():
    """Before: (4, 7) with x (4, 8) was torch's unnamed 'size of tensor a (8) must match ...'; and
    x (4, 1), weight (1,), residual (4, 8) returned a (4, 8) result normalised over 8 channels
    with the one-element weight broadcast over them, where rms_norm's weight is one per channel."""
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual \(4, 7\).*x \(4, 8\)"):
        fused_add_rms_norm(x, torch.randn(4, 7, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"residual \(4, 8\).*x \(4, 1\).*weight"):
        fused_add_rms_norm(torch.randn(4, 1, device=DEVICE), torch.randn(4, 8, device=DEVICE), torch.ones(1))


def test_fused_add_residual_that_broadcasts_keeps_working(seed):
    """A residual that broadcasts over x's rows (the documented reference path) still runs."""
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    for shape in ((8,), (4, 1), (2, 4, 8)):
        r = torch.randn(shape, device=DEVICE)
        normed, summed = fused_add_rms_norm(x, r, w, 1e-6)
        want = x.double() + r.double()
        torch.testing.assert_close(summed.double(), want, msg=f"{shape} seed={seed}")
        torch.testing.assert_close(normed.double(), _rms_by_hand(want, w, 1e-6), rtol=1e-5, atol=1e-5)


# --- linear_cross_entropy: strided targets --------------------------------------------------------


@NEEDS_TRITON
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("layout", ["column", "every_other", "expanded"])
def test_linear_ce_reads_strided_targets_by_their_strides(layout, reduction, seed):
    """Before: the row kernel read targets[i] at offset i whatever their stride, so a column of a
    [N, 2] label tensor or every other label gave another token's target (loss off by ~0.7 and
    wrong gradients at N=9, V=13), and an expanded (stride-0) target read past it (NaN)."""
    n, d, v = 9, 16, 13
    hidden = torch.randn(n, d, device=DEVICE, requires_grad=True)
    weight = torch.randn(v, d, device=DEVICE, requires_grad=True)
    targets = {
        "column": torch.randint(0, v, (n, 2), device=DEVICE)[:, 0],
        "every_other": torch.randint(0, v, (2 * n,), device=DEVICE)[::2],
        "expanded": torch.tensor(3, device=DEVICE).expand(n),
    }[layout]
    assert not targets.is_contiguous()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = h64 @ w64.t()
    want = torch.logsumexp(logits, -1) - logits.gather(1, targets.long()[:, None])[:, 0]
    want = want if reduction == "none" else want.mean()
    ctx = _no_fallback()
    try:
        loss = linear_cross_entropy(hidden, weight, targets, reduction=reduction)
        loss.sum().backward()
    finally:
        ctx.__exit__(None, None, None)
    want.sum().backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


# --- causal_select: a strided count_out -----------------------------------------------------------


@NEEDS_TRITON
def test_causal_select_writes_a_strided_count_out_by_its_stride(seed):
    """Before: the kernel stored count[b] at offset b of count_out, so a column of a [B, 2] buffer
    got its counts spread over both columns of the first rows (the neighbours overwritten)."""
    b, n, k = 3, 10, 5
    logit, tau = torch.randn(b, n, device=DEVICE), torch.tensor(0.0, device=DEVICE)
    consts = (1 << 15, 16, 1 << 16, k)
    buf = torch.full((b, 2), -7, dtype=torch.long, device=DEVICE)
    ctx = _no_fallback()
    try:
        out = causal_select(logit, tau, None, None, *consts, count_out=buf[:, 0])
    finally:
        ctx.__exit__(None, None, None)
    want = causal_select_ref(logit, tau, None, None, *consts)
    assert torch.equal(buf[:, 0], want[-1]), f"seed={seed}: {buf.tolist()} vs {want[-1].tolist()}"
    assert (buf[:, 1] == -7).all(), f"seed={seed}: the other column was written: {buf.tolist()}"
    assert out[-1].data_ptr() == buf.data_ptr()  # count is the caller's buffer, as documented
    for got, ref in zip(out[:-1], want[:-1], strict=True):
        assert torch.equal(got, ref), f"seed={seed}"


# --- tile_linear: a strided bias ----------------------------------------------------------------


@NEEDS_TRITON
def test_tile_linear_reads_a_strided_bias_by_its_stride(seed):
    """Before: the kernel read bias[n] at offset n, so a bias that is a column of a [N, 2] tensor
    (or any strided view) added the wrong values (error ~3.5 at N=70)."""
    w = torch.randn(70, 40, device=DEVICE)
    w[:, 20:] = 0  # mostly-zero, as the op is for
    bias = torch.randn(70, 2, device=DEVICE)[:, 0]
    x = torch.randn(3, 40, device=DEVICE)
    ctx = _no_fallback()
    try:
        got = tile_linear(x, pack_tiles(w, 16, 16), bias)
    finally:
        ctx.__exit__(None, None, None)
    want = x.double() @ w.double().t() + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


# --- a shape the op unpacks before checking -------------------------------------------------------


def test_kv_prefill_with_k_of_another_rank_names_k():
    """Before: 'not enough values to unpack (expected 4, got 3)', naming nothing."""
    k = torch.randn(2, 3, 4, device=DEVICE)
    cache = torch.zeros(2, 3, 8, 4, device=DEVICE)
    length = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_prefill_: .*k \(2, 3, 4\)"):
        kv_prefill_(k, k, cache, cache.clone(), torch.zeros(2, 8, device=DEVICE), length)


# --- tensors on two devices -----------------------------------------------------------------------
# A Triton kernel launches on one device and reads every pointer there: a tensor on another GPU is
# an illegal memory access (no peer access) or a silent peer read. These tests put one argument
# on the meta device beside CPU tensors (no second GPU is needed to see the check); before, each
# call failed deep in a reference with torch's unnamed 'Tensor on device meta is not on the
# expected device cpu!', or with another error that did not name the argument.


def _device_cases():
    from hydra_kernels import ccgqa_conv, qk_norm, qk_norm_rope, rms_norm, rope, swiglu
    from hydra_kernels.ops.ccgqa_prefill import ccgqa_prefill
    from hydra_kernels.ops.gated_update import gated_update_
    from hydra_kernels.ops.kv_decode import kv_decode_step
    from hydra_kernels.ops.router_decide import router_decide
    from hydra_kernels.ops.router_logit import router_logit

    def r(*shape, **kw):
        return torch.randn(*shape, device=DEVICE, **kw)

    def on(device, t):  # t itself, or an empty tensor like it on ``device``
        return t if device is None else torch.empty_like(t, device=device)

    x, w, ang = r(4, 8), r(8), r(5, 4)
    q, temp, cos, sin = r(2, 5, 3, 16), r(3), ang.cos(), ang.sin()
    long = dict(dtype=torch.long, device=DEVICE)
    b, e = 3, 8
    zeros_b, flag = torch.zeros(b, **long), torch.zeros((), dtype=torch.bool, device=DEVICE)
    taken, weight_out = torch.zeros(b, dtype=torch.bool, device=DEVICE), torch.zeros(b, device=DEVICE)
    cache = torch.zeros(2, 1, 6, 4, device=DEVICE)
    proj = r(2, 5, 8 + 6)
    # (op, argument put elsewhere, call(dev) with that argument on dev, or as it is for None)
    return [
        ("rms_norm", "weight", lambda d: rms_norm(x, on(d, w))),
        ("fused_add_rms_norm", "residual", lambda d: fused_add_rms_norm(x, on(d, x), w)),
        ("fused_add_rms_norm", "weight", lambda d: fused_add_rms_norm(x, x, on(d, w))),
        ("swiglu", "up", lambda d: swiglu(x, on(d, x))),
        ("qk_norm", "temperature", lambda d: qk_norm(q, 2.0, on(d, temp))),
        ("rope", "sin", lambda d: rope(q, cos, on(d, sin))),
        ("qk_norm_rope", "cos", lambda d: qk_norm_rope(q, 2.0, None, on(d, cos), on(d, sin))),
        ("qk_norm_rope", "temperature", lambda d: qk_norm_rope(q, 2.0, on(d, temp), cos, sin)),
        ("ccgqa_conv", "weight", lambda d: ccgqa_conv(r(2, 9, 32), on(d, r(2, 3, 16, 16)), r(32))),
        ("ccgqa_conv", "bias", lambda d: ccgqa_conv(r(2, 9, 32), r(2, 3, 16, 16), on(d, r(32)))),
        ("router_logit", "w", lambda d: router_logit(r(b, e), on(d, r(e)), r(()), 1e-6)),
        ("router_decide", "count", lambda d: router_decide(
            r(b, e), r(e), r(()), r(()), zeros_b, on(d, zeros_b.clone()), 1 << 15, 16, 1 << 16, 1e-6,
            taken, weight_out, flag)),
        ("kv_decode_step", "length", lambda d: kv_decode_step(
            r(2, 2, 4), r(2, 1, 4), r(2, 4), cache.clone(), cache.clone(), on(d, torch.zeros(2, **long)),
            torch.zeros(2, 6, device=DEVICE))),
        ("tile_linear", "bias", lambda d: tile_linear(r(3, 32), pack_tiles(r(32, 32), 16, 16), on(d, r(32)))),
        ("causal_select", "candidates", lambda d: causal_select(
            r(b, 10), r(()), on(d, torch.ones(b, 10, dtype=torch.bool, device=DEVICE)), None,
            1 << 15, 16, 1 << 16, 5)),
        ("gated_update_", "take", lambda d: gated_update_(
            r(b, e), r(b, e), r(b), on(d, torch.ones(b, dtype=torch.bool, device=DEVICE)))),
        ("ccgqa_prefill", "length", lambda d: ccgqa_prefill(proj, 8, 2, on(d, torch.tensor([3, 5], **long)))),
        ("kv_prefill_", "bias", lambda d: kv_prefill_(
            r(2, 1, 3, 4), r(2, 1, 3, 4), cache.clone(), cache.clone(), on(d, r(2, 6)),
            torch.zeros(2, **long))),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_device_cases())), ids=[f"{c[0]}-{c[1]}" for c in _device_cases()])
def test_an_argument_on_another_device_is_named(case):
    op, name, call = _device_cases()[case]
    call(None)  # the same call on one device runs
    with pytest.raises(ValueError, match=rf"{op}: {name} .* is on meta .* on {DEVICE.type}"):
        call("meta")
