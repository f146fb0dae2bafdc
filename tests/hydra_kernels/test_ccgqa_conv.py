"""ccgqa_conv: Triton kernels (interpreted on CPU) against an fp64 reference and a by-hand loop.

Every output and gradient must satisfy |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol
(hydra_kernels.numerics): elementwise in fp32, on the largest errors in bf16, where the reference
rounds its product before adding the bias and the kernel rounds once, so their rounding errors
differ element by element. Inputs are fresh random each run; the seed is in every failure message.
"""

import math

import pytest
import torch

from hydra_kernels import ccgqa_conv, controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import ccgqa_conv as conv_mod
from hydra_kernels.ops.ccgqa_conv import ccgqa_conv_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _inputs(b, n, g, k, d, dtype, row_pad=0):
    """window [B, n + K − 1, G·d] (a column slice of a wider tensor when ``row_pad``: rows strided,
    channels contiguous, as the model's projection gives it), weight [G, K, d, d], bias [G·d]."""
    wide = torch.randn(b, n + k - 1, g * d + row_pad, device=DEVICE).to(dtype).requires_grad_()
    window = wide  # the caller slices it when row_pad
    weight = (torch.randn(g, k, d, d, device=DEVICE) / math.sqrt(d * k)).requires_grad_()
    bias = (0.1 * torch.randn(g * d, device=DEVICE)).requires_grad_()
    return wide, window, weight, bias


def _run(fn, window, weight, bias, upstream, cut=None):
    w = window if cut is None else window[..., :cut]
    z = fn(w, weight, bias)
    return (z, *torch.autograd.grad((z.double() * upstream.double()).sum(), (window, weight, bias)))


def _check(window, weight, bias, seed, cut=None):
    b, length, _ = window.shape
    g, k, d, _ = weight.shape
    upstream = torch.randn(b, length - k + 1, g, d, device=DEVICE)
    kern = _run(ccgqa_conv, window, weight, bias, upstream, cut)
    assert "CCGQAConv" in type(kern[0].grad_fn).__name__, f"reference ran instead: {kern[0].grad_fn}"
    same = _run(ccgqa_conv_ref, window, weight, bias, upstream, cut)
    leaves64 = [t.detach().double().requires_grad_() for t in (window, weight, bias)]
    ref = _run(ccgqa_conv_ref, *leaves64, upstream, cut)
    for name, kv, tv, rv in zip(("z", "dwindow", "dweight", "dbias"), kern, same, ref, strict=True):
        assert kv.dtype == tv.dtype and kv.shape == tv.shape, f"{name}: {kv.dtype} vs {tv.dtype}"
        reduction = "elementwise" if window.dtype == torch.float32 else "max"
        res = check_against_fp64(kv, tv, rv, atol=fp32_noise_atol(rv), reduction=reduction)
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert controls.fallback_counts()["ccgqa_conv"] == 0
    return kern


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    # n < a block (two sizes); K = 4; two blocks and a tail at the default 128 rows (fp32 takes 64)
    [(2, 70, 2, 3, 16), (1, 5, 3, 2, 32), (3, 64, 1, 4, 16), (1, 300, 1, 3, 16)],
)
def test_matches_fp64(shape, dtype, seed):
    _, window, weight, bias = _inputs(*shape, dtype)
    _check(window, weight, bias, seed)


def test_strided_rows_of_a_wider_projection(seed):
    """The window as a column slice of a wider tensor (rows strided): read in place, and its
    gradient lands in those columns only."""
    b, n, g, k, d = 2, 40, 2, 3, 16
    wide, _, weight, bias = _inputs(b, n, g, k, d, torch.bfloat16, row_pad=24)
    kern = _check(wide, weight, bias, seed, cut=g * d)
    assert torch.count_nonzero(kern[1][..., g * d :]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 70, 2, 3, 16), (1, 5, 3, 2, 32), (1, 130, 1, 4, 16)])
def test_zero_context_equals_the_zero_padded_window(shape, dtype, seed):
    """``zero_context``: x [B, n, C] (a column slice of the projection, rows strided) gives, bit
    for bit, what the window with K − 1 zero rows in front gives: z, the weight's and bias's
    gradients, and x's gradient (the padded window's gradient without its first K − 1 rows)."""
    b, n, g, k, d = shape
    proj = torch.randn(b, n, g * d + 24, device=DEVICE).to(dtype)
    x = proj[..., : g * d].detach().requires_grad_()
    assert not x.is_contiguous()
    window = torch.nn.functional.pad(x.detach(), (0, 0, k - 1, 0)).requires_grad_()
    _, _, weight, bias = _inputs(b, n, g, k, d, dtype)
    upstream = torch.randn(b, n, g, d, device=DEVICE)
    z = ccgqa_conv(x, weight, bias, True)
    assert "CCGQAConv" in type(z.grad_fn).__name__, f"reference ran instead: {z.grad_fn}"
    got = (z, *torch.autograd.grad((z.double() * upstream.double()).sum(), (x, weight, bias)))
    z_pad = ccgqa_conv(window, weight, bias)
    want = list(torch.autograd.grad((z_pad.double() * upstream.double()).sum(), (window, weight, bias)))
    want = (z_pad, want[0][:, k - 1 :], *want[1:])
    for name, gv, wv in zip(("z", "dx", "dweight", "dbias"), got, want, strict=True):
        assert gv.shape == wv.shape and torch.equal(gv, wv), f"{name} (seed={seed})"
    # and against fp64 through the reference's own zero_context
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    z64 = ccgqa_conv_ref(*leaves64, True)
    ref = (z64, *torch.autograd.grad((z64 * upstream.double()).sum(), leaves64))
    same_leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    z_same = ccgqa_conv_ref(*same_leaves, True)
    same = (z_same, *torch.autograd.grad((z_same.double() * upstream.double()).sum(), same_leaves))
    for name, kv, tv, rv in zip(("z", "dx", "dweight", "dbias"), got, same, ref, strict=True):
        reduction = "elementwise" if dtype == torch.float32 else "max"
        res = check_against_fp64(kv, tv, rv, atol=fp32_noise_atol(rv), reduction=reduction)
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert controls.fallback_counts()["ccgqa_conv"] == 0


# (B, n, heads, K, d, query heads): G = 3 as the 100M preset, G = 2, G = 1; one block and a tail
QK_MEAN_CASES = [(2, 37, 8, 3, 16, 6), (1, 150, 6, 3, 16, 4), (2, 20, 4, 2, 32, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_context", [False, True])
@pytest.mark.parametrize("case", QK_MEAN_CASES)
def test_qk_mean_matches_fp64(case, zero_context, dtype, seed):
    """``qk_mean_heads``: the q-k mean added inside the kernels (forward, and its transpose in the
    window's gradient) against the fp64 reference, by the rule the plain conv meets; u given in
    place (zero_context) or as a window with its context rows."""
    b, n, g, k, d, q = case
    wide, window, weight, bias = _inputs(b, n, g, k, d, dtype)
    if zero_context:
        window = wide.detach()[:, k - 1 :].clone().requires_grad_()
    upstream = torch.randn(b, n, g, d, device=DEVICE)

    def run(fn, *leaves):
        z = fn(*leaves, zero_context, q)
        return (z, *torch.autograd.grad((z.double() * upstream.double()).sum(), leaves))

    kern = run(ccgqa_conv, window, weight, bias)
    assert "CCGQAConv" in type(kern[0].grad_fn).__name__, f"reference ran instead: {kern[0].grad_fn}"
    same = run(ccgqa_conv_ref, *[t.detach().requires_grad_() for t in (window, weight, bias)])
    ref = run(ccgqa_conv_ref, *[t.detach().double().requires_grad_() for t in (window, weight, bias)])
    for name, kv, tv, rv in zip(("z", "dwindow", "dweight", "dbias"), kern, same, ref, strict=True):
        assert kv.dtype == tv.dtype and kv.shape == tv.shape, name
        reduction = "elementwise" if dtype == torch.float32 else "max"
        res = check_against_fp64(kv, tv, rv, atol=fp32_noise_atol(rv), reduction=reduction)
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert controls.fallback_counts()["ccgqa_conv"] == 0
    # the mean is really there: without it the output moves by more than rounding
    plain = ccgqa_conv(window, weight, bias, zero_context).double()
    assert (plain - kern[0].double()).abs().max() > 0.1


def test_qk_mean_ref_by_hand(seed):
    """qk_mean_ref against CCGQA's formula written head by head in fp64: query head h gets
    (u_q[h] + u_k[h // G]) / 2, key head j the mean over its query heads of the same."""
    from hydra_kernels.ops.ccgqa_conv import qk_mean_ref

    b, n, q, kv, d = 2, 5, 6, 2, 8
    group = q // kv
    u = torch.randn(b, n, (q + kv) * d, dtype=torch.float64)
    got = qk_mean_ref(u, q, d)
    heads = u.view(b, n, q + kv, d)
    for h in range(q):
        want = 0.5 * (heads[:, :, h] + heads[:, :, q + h // group])
        torch.testing.assert_close(got[:, :, h], want, rtol=0, atol=1e-12)
    for j in range(kv):
        pairs = [0.5 * (heads[:, :, i] + heads[:, :, q + j]) for i in range(j * group, (j + 1) * group)]
        want = sum(pairs) / group
        torch.testing.assert_close(got[:, :, q + j], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "heads, q, ok", [(8, 6, True), (5, 4, True), (8, -1, False), (8, 3, False), (8, 5, False), (8, 8, False)]
)
def test_qk_mean_heads_must_be_the_query_heads(heads, q, ok):
    """Query heads: fewer than the heads, a multiple of the key heads (the rest); else a
    ValueError that names the argument."""
    _, window, weight, bias = _inputs(1, 6, heads, 2, 16, torch.float32)
    if ok:
        assert ccgqa_conv(window, weight, bias, False, q).shape == (1, 6, heads, 16)
        return
    with pytest.raises(ValueError, match="qk_mean_heads"):
        ccgqa_conv(window, weight, bias, False, q)


def test_by_hand_loop_and_causality(seed):
    """z[t] = bias + Σ_s W[s] · window[t + s], written as a loop in fp64; and z[t] does not move
    when window rows after t + K − 1 change."""
    b, n, g, k, d = 1, 20, 2, 3, 16
    _, window, weight, bias = _inputs(b, n, g, k, d, torch.float32)
    z = ccgqa_conv(window, weight, bias).double()
    w64, win64 = weight.detach().double(), window.detach().double().view(b, n + k - 1, g, d)
    for t in range(n):
        for head in range(g):
            want = bias.detach().double().view(g, d)[head].clone()
            for s in range(k):
                want += w64[head, s] @ win64[0, t + s, head]
            torch.testing.assert_close(z[0, t, head], want, rtol=1e-5, atol=1e-5)
    later = window.detach().clone()
    later[:, 10 + k - 1 :] = torch.randn_like(later[:, 10 + k - 1 :])
    z2 = ccgqa_conv(later, weight, bias)
    torch.testing.assert_close(z2[:, :10], z[:, :10].to(z2.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("qk_mean_heads", [0, 2])
def test_under_torch_compile_the_custom_op_gives_the_same_bits(qk_mean_heads, seed):
    _, window, weight, bias = _inputs(2, 33, 3, 3, 16, torch.bfloat16)
    upstream = torch.randn(2, 33, 3, 16, device=DEVICE)

    def conv(*args):
        return ccgqa_conv(*args, False, qk_mean_heads)

    eager = _run(conv, window, weight, bias, upstream)
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    got = _run(compiled, window, weight, bias, upstream)
    for e, c in zip(eager, got, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    torch._dynamo.reset()


def test_the_custom_ops_fakes_match_what_they_return(seed):
    """torch's own opcheck (schema, fake tensors' shapes and strides, autograd registration) on
    the inputs as the model passes them: a column slice of a wider projection for the window and
    a permuted [heads, K, d, d] view for the weight (inductor asserts the fake's strides)."""
    b, n, g, k, d = 2, 20, 2, 3, 16
    wide, _, _, bias = _inputs(b, n, g, k, d, torch.bfloat16, row_pad=8)
    window = wide.detach()[..., : g * d].requires_grad_()
    weight = torch.randn(g, d, d, k, device=DEVICE).permute(0, 3, 1, 2).requires_grad_()
    assert not weight.is_contiguous() and not window.is_contiguous()
    torch.library.opcheck(conv_mod._ccgqa_conv_fwd_op, (window, weight, bias))
    dz = torch.randn(b, n, g, d, device=DEVICE).to(torch.bfloat16)
    torch.library.opcheck(conv_mod._ccgqa_conv_bwd_op, (dz, window.detach(), weight.detach(), bias.detach()))
    # with the q-k mean (one query head, one key head) and u in place (n + K - 1 tokens)
    torch.library.opcheck(conv_mod._ccgqa_conv_fwd_op, (window, weight, bias, True, 1))
    dz_u = torch.randn(b, n + k - 1, g, d, device=DEVICE).to(torch.bfloat16)
    args = (dz_u, window.detach(), weight.detach(), bias.detach(), True, 1)
    torch.library.opcheck(conv_mod._ccgqa_conv_bwd_op, args)
    assert controls.fallback_counts()["ccgqa_conv"] == 0


@pytest.mark.fallback_expected
def test_a_launch_override_changes_the_blocks_not_the_result(seed):
    """block_rows 16 (four programs where the default takes one) gives what the fp64 reference
    says; a block_rows tl.dot cannot tile is refused: counted, and the reference answers."""
    from hydra_kernels.launch_config import set_launch_overrides

    set_launch_overrides("ccgqa_conv", block_rows=16)
    _, window, weight, bias = _inputs(2, 50, 2, 3, 16, torch.float32)
    _check(window, weight, bias, seed)
    set_launch_overrides("ccgqa_conv", block_rows=8)
    with pytest.warns(RuntimeWarning, match="block_rows=8"):
        out = ccgqa_conv(window, weight, bias)
    torch.testing.assert_close(out, ccgqa_conv_ref(window, weight, bias))
    assert controls.fallback_counts()["ccgqa_conv"] == 1


@pytest.mark.fallback_expected
def test_what_the_kernels_do_not_take_runs_the_reference():
    window = torch.randn(1, 10, 2 * 24, device=DEVICE).requires_grad_()  # heads of 24: no tl.dot tile
    weight, bias = torch.randn(2, 3, 24, 24, device=DEVICE), torch.randn(48, device=DEVICE)
    z = ccgqa_conv(window, weight, bias)
    assert "CCGQAConv" not in type(z.grad_fn).__name__  # the reference's own autograd graph
    z64 = ccgqa_conv(window.double(), weight.double(), bias.double())
    assert z64.dtype == torch.float64
    torch.testing.assert_close(z.double(), z64, rtol=1e-5, atol=1e-5)
    # fp32 heads wider than FP32_MAX_HEAD_DIM: the reference too (the kernel's fp32 build is slow)
    wide = torch.randn(1, 6, 128, device=DEVICE).requires_grad_()
    z = ccgqa_conv(wide, torch.randn(1, 3, 128, 128, device=DEVICE), torch.randn(128, device=DEVICE))
    assert conv_mod.FP32_MAX_HEAD_DIM < 128 and "CCGQAConv" not in type(z.grad_fn).__name__
    with pytest.raises(ValueError, match="G·d = C"):
        ccgqa_conv(window, torch.randn(3, 3, 24, 24), bias)
    with pytest.raises(ValueError, match="expected window"):
        ccgqa_conv(window[0], weight, bias)
    # a direct call of the custom op with such a shape: the kernel refuses, counted, reference answers
    with pytest.warns(RuntimeWarning, match="ccgqa_conv kernel failed"):
        out = conv_mod._ccgqa_conv_fwd_op(window, weight, bias)
    torch.testing.assert_close(out, ccgqa_conv_ref(window, weight, bias))
    assert controls.fallback_counts()["ccgqa_conv"] == 1


def test_switched_off_runs_the_reference(monkeypatch):
    monkeypatch.setenv("HYDRA_DISABLE_FUSED_CCGQA_CONV", "1")
    controls.reload_env()
    _, window, weight, bias = _inputs(1, 8, 1, 3, 16, torch.float32)
    assert ccgqa_conv(window, weight, bias).grad_fn is not None
    assert "CCGQAConv" not in type(ccgqa_conv(window, weight, bias).grad_fn).__name__


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    bf, f32 = "*bf16", "*fp32"
    fwd = {"WIN": bf, "W": bf, "BIAS": f32, "Z": bf, "n": "i32", "stride_wb": "i32", "stride_wt": "i32"}
    dwin = {"DZ": bf, "W": bf, "DWIN": bf, "n": "i32"}
    dw = {"DZ": bf, "WIN": bf, "PW": f32, "PB": f32, "n": "i32", "n_blocks": "i32", "blocks_per_seq": "i32",
          "stride_wb": "i32", "stride_wt": "i32"}  # fmt: skip
    # a stored window, and one whose K − 1 context rows are zeros (zero_context); without and with
    # the q-k mean (the 100M preset's 12 query heads, 3 a key head)
    for pad, n_q in ((0, 0), (2, 0), (2, 12), (0, 12)):
        consts = {"N_HEADS": 16, "K": 3, "D": 64, "BLOCK_T": conv_mod.LAUNCH["default"].block_rows,
                  "IEEE": False, "PAD": pad}  # fmt: skip
        mean = {"N_Q": n_q, "GROUP": 3 if n_q else 1}
        build_sm90(conv_mod._ccgqa_conv_fwd_kernel, fwd, {**consts, **mean}, 4, 2)
        build_sm90(conv_mod._ccgqa_conv_dwin_kernel, dwin, {**consts, **mean}, 4, 2)
        if not n_q:  # the weight's gradient takes no q-k mean
            build_sm90(conv_mod._ccgqa_conv_dw_kernel, dw, {**consts, "ITERS": 8}, 4, 2)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler; compile for sm_90 here so that GPU-only errors
    show on a CPU-only machine too."""
    assert_compiles_for_sm90(__file__)


def test_an_fp32_window_under_autocast_runs_in_autocasts_dtype(seed):
    """As the reference's einsum does under autocast: the kernel gets the window cast to bf16 and
    returns bf16, the window's gradient coming back in fp32 through the cast."""
    _, window, weight, bias = _inputs(1, 20, 2, 3, 16, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        z = ccgqa_conv(window, weight, bias)
        r = ccgqa_conv_ref(window, weight, bias)
    assert z.dtype == r.dtype == torch.bfloat16
    z.float().sum().backward()
    assert window.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(z.float(), r.float(), rtol=2e-2, atol=2e-2)
