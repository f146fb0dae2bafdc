"""linear_cross_entropy: the Triton path (interpreted on the CPU) and the chunked PyTorch path
against float64, plus the promises of the op: no [N, V] allocation, no graph break under
torch.compile, counted fallbacks, skipped work for frozen or eval inputs, Liger hand-off rules.

Shapes are odd on purpose: N = 37 tokens in chunks of 16 (the last one partial), D = 48 and
V = 301 (neither a power of two nor a multiple of any tile), about a fifth of the targets ignored.
"""

import os
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hydra_kernels import controls
from hydra_kernels.launch_config import clear_launch_overrides, set_launch_overrides
from hydra_kernels.modules import HydraLinearCrossEntropyLoss
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import _linear_ce_chunks as chunks
from hydra_kernels.ops import _linear_ce_kernels as kernels
from hydra_kernels.ops import _linear_ce_liger as liger
from hydra_kernels.ops.linear_cross_entropy import (
    grad_rounding_atol,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    reset_linear_ce_options,
    set_linear_ce_options,
)

N, D, V, CHUNK = 37, 48, 301, 16
OP = "linear_cross_entropy"
pytestmark = pytest.mark.skipif(not controls.INTERPRETER_ACTIVE, reason="needs TRITON_INTERPRET=1 (CPU CI)")


@pytest.fixture(autouse=True)
def _clean_state():
    set_linear_ce_options(chunk_rows=CHUNK)
    controls.set_op_enabled(OP, True)
    controls.reset_fallback_counts()
    yield
    reset_linear_ce_options()
    clear_launch_overrides()
    controls.set_op_enabled(OP, True)
    controls.set_use_liger_ce(False)


def _inputs(seed, n=N, d=D, v=V, ignored=0.2):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = 0.3 * torch.randn(v, d, generator=gen, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=gen)
    y[torch.rand(n, generator=gen) < ignored] = -100
    return h, w, y


def _grad_out(reduction, n, grad_scale=1.0):
    """What the loss is multiplied by before backward: fixed per-token weights for "none"."""
    if reduction == "none":
        return torch.linspace(-1.0, 2.0, n, dtype=torch.float64)
    return torch.tensor(grad_scale, dtype=torch.float64)


def _run(fn, h, w, y, dtype, reduction, z_loss, grad_scale=1.0, w_dtype=None):
    """fn's output and the gradients of ``sum(out · grad_out)``."""
    # fresh leaves every call (h.to(float64) would return h itself and share its .grad)
    hh = h.detach().to(dtype, copy=True).requires_grad_()
    ww = w.detach().to(w_dtype or dtype, copy=True).requires_grad_()
    out = fn(hh, ww, y, -100, reduction, z_loss)
    (out * _grad_out(reduction, out.numel(), grad_scale).to(out.dtype)).sum().backward()
    return out.detach(), hh.grad, ww.grad


def _check(got, same, ref, extra_atol=0.0):
    """numerics.check_against_fp64 with an elementwise atol: the criterion
    |k − r| ≤ 2·|t − r| + atol is unchanged when k, t, r and atol are all divided by atol."""
    atol = fp32_noise_atol(ref) + extra_atol
    if isinstance(atol, torch.Tensor):
        return check_against_fp64(got.double() / atol, same.double() / atol, ref / atol, 1.0)
    return check_against_fp64(got, same, ref, atol)


def _assert_criterion(h, w, y, dtype, reduction, z_loss, grad_scale=1.0):
    """Every output and gradient: |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol. atol:
    numerics.fp32_noise_atol (16 fp32 ulps of the largest reference value: reordering noise where
    torch happens to be nearly exact, ~500× below a bf16 ulp), plus for the gradients
    grad_rounding_atol: one element of the bf16 logits gradient rounded the other way than in
    torch, and one logit one ulp off (see its docstring; about one bf16 ulp of the largest single
    term of each sum)."""
    got = _run(linear_cross_entropy, h, w, y, dtype, reduction, z_loss, grad_scale)
    same = _run(linear_cross_entropy_ref, h, w, y, dtype, reduction, z_loss, grad_scale)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, reduction, z_loss, grad_scale)
    g = _grad_out(reduction, h.shape[0], grad_scale)
    flip_dh, flip_dw = grad_rounding_atol(h, w, y, dtype, -100, reduction, z_loss, g)
    for name, k, t, r, extra in zip(
        ("loss", "dh", "dW"), got, same, ref, (0.0, flip_dh, flip_dw), strict=True
    ):
        assert k.dtype == t.dtype, (name, k.dtype, t.dtype)
        res = _check(k, t, r, extra)
        assert res, f"{dtype} {reduction} {name}: {res.describe()}"
    return got


@pytest.mark.parametrize(
    ("dtype", "reduction", "z_loss", "tweak"),
    [
        (torch.float32, "mean", 0.0, None),
        (torch.float32, "sum", 1e-3, "chunk40"),  # one chunk, two reduction steps in the dW GEMM
        (torch.bfloat16, "mean", 1e-3, "vblock64"),  # five vocabulary blocks per row
        (torch.bfloat16, "sum", 0.0, None),
        (torch.bfloat16, "none", 1e-3, None),
        (torch.float32, "none", 0.0, "vblock64"),
    ],
)
def test_triton_path_meets_fp64_criterion(dtype, reduction, z_loss, tweak):
    if tweak == "chunk40":
        set_linear_ce_options(chunk_rows=40)
    if tweak == "vblock64":
        set_launch_overrides("linear_cross_entropy_rows", block_q=64)
    h, w, y = _inputs(hash((str(dtype), reduction)) % 1000)
    assert controls.triton_path(OP, h.to(dtype), w.to(dtype))
    _assert_criterion(h, w, y, dtype, reduction, z_loss)
    assert controls.fallback_counts()[OP] == 0  # the kernels ran; no silent reference


def test_pytorch_chunked_path_meets_criterion_in_bf16_and_runs_fp64():
    controls.set_op_enabled(OP, False)
    h, w, y = _inputs(3)
    _assert_criterion(h, w, y, torch.bfloat16, "mean", 1e-3)
    loss64, dh64, dw64 = _run(linear_cross_entropy, h, w, y, torch.float64, "sum", 1e-3)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, "sum", 1e-3)
    for got, want in zip((loss64, dh64, dw64), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_incoming_gradient_scaling_and_second_backward_raises():
    h, w, y = _inputs(4)
    _assert_criterion(h, w, y, torch.bfloat16, "mean", 0.0, grad_scale=0.25)  # exact scaling
    # not a power of two: G was rounded before the scale was known (grad_rounding_atol's 2nd case)
    _assert_criterion(h, w, y, torch.bfloat16, "sum", 1e-3, grad_scale=0.7)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss = linear_cross_entropy(hh, ww, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # the gradients were scaled in place
        loss.backward()


def test_loose_allowance_for_unknown_grad_scale_still_catches_a_wrong_gradient():
    """grad_rounding_atol with a scale that is not a power of two counts both computations'
    roundings of G (the op's and torch's); a gradient off by a few allowances at one element, or
    one accumulated in bf16 over chunks (what the fp32 accumulator exists to prevent) must still
    fail."""
    h, w, y = _inputs(21)
    g = 0.7
    got = _run(linear_cross_entropy, h, w, y, torch.bfloat16, "sum", 1e-3, g)
    same = _run(linear_cross_entropy_ref, h, w, y, torch.bfloat16, "sum", 1e-3, g)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, "sum", 1e-3, g)
    _, loose_dw = grad_rounding_atol(h, w, y, torch.bfloat16, -100, "sum", 1e-3, torch.tensor(g))
    assert _check(got[2], same[2], ref[2], loose_dw)
    worst = int((loose_dw + fp32_noise_atol(ref[2])).argmax())
    bad = got[2].clone()
    bad.view(-1)[worst] += 8 * float((loose_dw + fp32_noise_atol(ref[2])).view(-1)[worst])
    assert not _check(bad, same[2], ref[2], loose_dw)
    set_linear_ce_options(chunk_rows=2, dw_accum="input")  # 19 bf16 roundings of each dW element
    lean = _run(linear_cross_entropy, h, w, y, torch.bfloat16, "sum", 1e-3, g)[2]
    assert not _check(lean, same[2], ref[2], loose_dw)


def _ref_with_logits_one_ulp_off(seed: int, count: int = 3):
    """linear_cross_entropy_ref in bf16, but with ``count`` rounded logits one ulp off (up or
    down), each in a row and a column of its own: what a logits GEMM that sums in another order
    gives (on an H100 the default mode's padded GEMM against torch's, about 6e-5 of them; three
    of these 11137 is 2.7e-4). They are the logits whose ulp moves G the most (largest p·ulp)."""

    def ref(hidden, weight, targets, ignore_index, reduction, z_loss):
        x = hidden @ weight.t()  # [N, V] bf16
        gen = torch.Generator().manual_seed(seed)
        ulp = torch.ldexp(torch.ones(x.shape), torch.frexp(x.detach().float())[1] - 8)  # bf16's spacing
        reach = torch.softmax(x.detach().float(), dim=-1) * ulp
        off = torch.zeros(x.shape)
        for _ in range(count):
            n, v = divmod(int(reach.argmax()), x.shape[1])
            off[n, v] = ulp[n, v] * (2 * int(torch.randint(0, 2, (), generator=gen)) - 1)
            reach[n, :], reach[:, v] = -1.0, -1.0  # a row and a column of its own
        logits = (x + off.to(x.dtype)).float()  # exact in bf16; the gradient passes through x
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
        valid = targets != ignore_index
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2) * valid
        return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()

    return ref


def _assert_logits_one_ulp_off_pass(h, w, y, reduction, seed):
    """At full strictness (incoming gradient 1), bf16: the reference with a few logits one ulp
    off (:func:`_ref_with_logits_one_ulp_off`) passes for dh and dW. → (torch's bf16 result, the
    fp64 result, dW's allowance)."""
    same = _run(linear_cross_entropy_ref, h, w, y, torch.bfloat16, reduction, 1e-3)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, reduction, 1e-3)
    flip_dh, flip_dw = grad_rounding_atol(h, w, y, torch.bfloat16, -100, reduction, 1e-3, torch.tensor(1.0))
    off = _run(_ref_with_logits_one_ulp_off(seed), h, w, y, torch.bfloat16, reduction, 1e-3)
    for name, k, t, r, extra in (
        ("dh", off[1], same[1], ref[1], flip_dh),
        ("dW", off[2], same[2], ref[2], flip_dw),
    ):
        res = _check(k, t, r, extra)
        assert res, f"seed {seed}, {name}: {res.describe()}"
    return same, ref, flip_dw


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_strict_allowance_covers_a_logit_one_ulp_off_and_still_catches_a_wrong_gradient(reduction):
    """At full strictness (incoming gradient 1), with logits of the check's scale: a computation
    whose bf16 logits are one ulp off torch's at a few of them, where they move G most, passes;
    a dW rounded to bf16 after each of 19 chunks (Liger's precision), or off by eight allowances
    at one element, fails."""
    seed = int.from_bytes(os.urandom(4), "little")
    h, w, y = _inputs(seed % 10_000)
    w = w / 3  # 0.1·randn weights: |logits| up to about 3, as in bench_linear_ce's check
    same, ref, flip_dw = _assert_logits_one_ulp_off_pass(h, w, y, reduction, seed)
    atol = flip_dw + fp32_noise_atol(ref[2])
    worst = int(atol.argmax())
    bad = same[2].clone()
    bad.view(-1)[worst] += 8 * float(atol.view(-1)[worst])
    assert not _check(bad, same[2], ref[2], flip_dw), f"seed {seed}"
    set_linear_ce_options(chunk_rows=2, dw_accum="input")  # 19 bf16 roundings of each dW element
    lean = _run(linear_cross_entropy, h, w, y, torch.bfloat16, reduction, 1e-3)[2]
    assert not _check(lean, same[2], ref[2], flip_dw), f"seed {seed}"


def test_strict_allowance_covers_a_logit_one_ulp_off_in_a_confident_row():
    """Three rows made confident (one logit of 7, p about 0.7) with that logit one ulp off: the
    softmax's normalisation moves every other entry of the row's G too, which the allowance
    counts (without that term such a case failed 16 of 20 seeds, at columns never flipped)."""
    seed = int.from_bytes(os.urandom(4), "little")
    h, w, y = _inputs(seed % 10_000)
    w = w / 3
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(h.shape[0], generator=gen)[:3].tolist()
    cols = torch.randperm(w.shape[0], generator=gen)[:3].tolist()
    for n, v in zip(rows, cols, strict=True):
        w[v] = 7.0 * h[n] / h[n].pow(2).sum()  # x[n, v] = 7
    _assert_logits_one_ulp_off_pass(h, w, y, "mean", seed)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(reduction):
    h, w, _ = _inputs(5)
    y = torch.full((N,), -100)
    loss, dh, dw = _run(linear_cross_entropy, h, w, y, torch.float32, reduction, 1e-3)
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_out_of_range_target_gives_nan_only_for_its_token():
    h, w, y = _inputs(6, ignored=0.0)
    y[3] = V + 7
    loss = linear_cross_entropy(h.float(), w.float(), y, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(torch.cat([loss[:3], loss[4:]])).all()


class _StorageBytes(TorchDispatchMode):
    """Records the largest storage (bytes) of any tensor an aten op returns. Bytes, not elements:
    the Triton interpreter copies whole storages as byte tensors."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_allocates_full_logits(triton, reduction):
    # Everything legitimate, even in fp32: the dW accumulator [Vp, D], dh [N, D], a chunk [16, Vp]
    # (Vp: V padded to chunks.PAD_COLS columns). The full bf16 logits [N, V] are 4× bigger than all of them.
    n, d, v = 256, 16, 301
    vp = -(-v // chunks.PAD_COLS) * chunks.PAD_COLS
    controls.set_op_enabled(OP, triton)
    h, w, y = _inputs(7, n=n, d=d, v=v)
    legit = 4 * max(vp * d, n * d, CHUNK * vp)
    assert 2 * n * v >= 4 * legit
    for fn in (linear_cross_entropy, linear_cross_entropy_ref):
        hh, ww = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        g = _grad_out(reduction, n).float()
        mode = _StorageBytes()
        with mode:  # forward and backward
            (fn(hh, ww, y, -100, reduction, 1e-3) * g).sum().backward()
        if fn is linear_cross_entropy:
            assert 0 < mode.largest <= legit, (mode.largest, legit, 2 * n * v)
        else:  # the detector itself: the reference does allocate [N, V]
            assert mode.largest >= 2 * n * v


@pytest.mark.parametrize(("dw_accum", "dtype"), [("fp32", torch.float32), ("compensated", torch.bfloat16)])
def test_compile_fullgraph_without_graph_breaks(dw_accum, dtype):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    set_linear_ce_options(chunk_rows=CHUNK, dw_accum=dw_accum)
    h, w, y = _inputs(8)
    for reduction in ("mean", "none"):

        def step(hh, ww, yy, reduction=reduction):
            out = linear_cross_entropy(hh, ww, yy, reduction=reduction, z_loss=1e-3)
            return out.sum() * 0.5

        torch._dynamo.reset()
        counters.clear()
        backend = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        hc, wc = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        compiled(hc, wc, y).backward()
        he, we = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        step(he, we, y).backward()
        assert wc.grad.dtype == dtype
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert backend.frame_count == 1
        assert "hydra_kernels.linear_ce_fwd" in backend.graphs[0].code
        torch.testing.assert_close(hc.grad, he.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(wc.grad, we.grad, rtol=1e-6, atol=1e-7)
    assert controls.fallback_counts()[OP] == 0


def test_non_contiguous_hidden():
    h, w, y = _inputs(9, n=36)
    # [B, S, D] view with B and S swapped and padded rows: reshape must copy, grads flow back
    base = torch.randn(6, 6, D + 5, dtype=torch.float64)
    base[..., :D] = h.reshape(6, 6, D).transpose(0, 1)
    h3 = base.float()[..., :D].transpose(0, 1).requires_grad_()  # [6, 6, D], non-contiguous
    assert not h3.is_contiguous()
    loss = linear_cross_entropy(h3, w.float(), y.reshape(6, 6), reduction="sum")
    loss.backward()
    hh = h.float().requires_grad_()
    want = linear_cross_entropy(hh, w.float(), y, reduction="sum")
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(h3.grad.reshape(36, D), hh.grad)
    # a row-strided 2-D view stays a view: the chunk GEMMs and the dW kernel read it in place
    h2, w2, y2 = _inputs(10)
    wide = torch.randn(N, D + 7, dtype=torch.float64)
    wide[:, :D] = h2
    wide = wide.float().requires_grad_()
    view = wide[:, :D]  # [N, D], row stride D + 7
    assert view.stride() == (D + 7, 1)
    loss = linear_cross_entropy(view, w2.float().requires_grad_(), y2)
    loss.backward()
    same = _run(linear_cross_entropy_ref, h2, w2, y2, torch.float32, "mean", 0.0)
    ref = _run(linear_cross_entropy_ref, h2, w2, y2, torch.float64, "mean", 0.0)
    assert _check(loss, same[0], ref[0]) and _check(wide.grad[:, :D], same[1], ref[1])
    assert torch.equal(wide.grad[:, D:], torch.zeros(N, 7))


def test_bf16_hidden_with_fp32_weight_and_autocast():
    h, w, y = _inputs(11)
    hb, wf = h.bfloat16().requires_grad_(), w.float().requires_grad_()
    loss = linear_cross_entropy(hb, wf, y, z_loss=1e-3)
    loss.backward()
    assert wf.grad.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    hb2, wb = h.bfloat16().requires_grad_(), w.float().requires_grad_()  # torch: W cast for the matmul
    same = linear_cross_entropy_ref(hb2, wb.bfloat16(), y, z_loss=1e-3)
    same.backward()
    h64, w64 = h.bfloat16().double().requires_grad_(), w.float().bfloat16().double().requires_grad_()
    ref = linear_cross_entropy_ref(h64, w64, y, z_loss=1e-3)
    ref.backward()
    flip_dh, flip_dw = grad_rounding_atol(h, w, y, torch.bfloat16, z_loss=1e-3)
    assert _check(loss, same, ref) and _check(hb.grad, hb2.grad, h64.grad, flip_dh)
    # torch's dW went through a bf16 GEMM output (rounded) before the cast back to fp32; ours is
    # the fp32 accumulator itself: the criterion plus the half bf16 ulp torch's rounding added.
    assert _check(wf.grad, wb.grad, w64.grad, flip_dw + 2.0**-9 * w64.grad.abs())
    err, torch_err = (wf.grad.double() - w64.grad).abs(), (wb.grad.double() - w64.grad).abs()
    assert err.mean() <= torch_err.mean()
    # under autocast, fp32 inputs are multiplied in bf16 and the grads come back in fp32
    hf, wf2 = h.float().requires_grad_(), w.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ac = linear_cross_entropy(hf, wf2, y, z_loss=1e-3)
    loss_ac.backward()
    torch.testing.assert_close(loss_ac, loss)
    assert hf.grad.dtype == torch.float32 and wf2.grad.dtype == torch.float32
    torch.testing.assert_close(wf2.grad, wf.grad)


def test_frozen_weight_and_eval_skip_gradient_work(monkeypatch):
    h, w, y = _inputs(12)
    calls = []
    monkeypatch.setattr(chunks, "_accumulate_dw", lambda *a, **k: calls.append("dW"))
    hh, ww = h.float().requires_grad_(), w.float()  # frozen head
    linear_cross_entropy(hh, ww, y).backward()
    assert not calls and ww.grad is None
    hr = h.float().requires_grad_()
    linear_cross_entropy_ref(hr, w.float(), y).backward()
    torch.testing.assert_close(hh.grad, hr.grad)

    seen = []
    real = kernels.launch_ce_rows
    monkeypatch.setattr(kernels, "launch_ce_rows", lambda *a: (seen.append(a[-1]), real(*a)))
    with torch.no_grad():
        loss = linear_cross_entropy(h.float().requires_grad_(), w.float().requires_grad_(), y)
    assert seen and not any(seen) and not calls  # no logits gradient written, no dW
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h.float(), w.float(), y))


@pytest.mark.fallback_expected
def test_kernel_failure_is_counted_warned_and_answered_correctly(monkeypatch):
    h, w, y = _inputs(13)

    def broken(*args):
        raise RuntimeError("simulated kernel fault")

    monkeypatch.setattr(kernels, "launch_ce_rows", broken)
    with pytest.warns(RuntimeWarning, match="linear_cross_entropy kernel failed"):
        _assert_criterion(h, w, y, torch.bfloat16, "mean", 1e-3)
    assert controls.fallback_counts()[OP] >= 1
    assert "simulated kernel fault" in controls.get_kernel_status()["ops"][OP]["last_error"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dw_backends_agree(backend):
    set_linear_ce_options(chunk_rows=CHUNK, dw_backend=backend)
    h, w, y = _inputs(14)
    _assert_criterion(h, w, y, torch.bfloat16, "sum", 0.0)


@pytest.mark.parametrize(
    ("dtype", "reduction", "z_loss", "triton"),
    [
        (torch.bfloat16, "mean", 1e-3, True),
        (torch.float32, "sum", 0.0, True),
        (torch.bfloat16, "none", 1e-3, True),
        (torch.bfloat16, "mean", 0.0, False),
    ],
)
def test_slab_scheme_meets_fp64_criterion(dtype, reduction, z_loss, triton):
    """dw_accum="slab": dh from the chunk loop, dW per vocabulary slab (128 columns here: 3 slabs,
    the last one partial) from a second logits pass — no accumulator, full precision."""
    set_linear_ce_options(chunk_rows=CHUNK, dw_accum="slab")
    assert chunks.slab_cols_for(N, V, CHUNK) == 128
    controls.set_op_enabled(OP, triton)
    h, w, y = _inputs(19 + int(triton))
    _assert_criterion(h, w, y, dtype, reduction, z_loss)
    assert controls.fallback_counts()[OP] == 0


def test_slab_scheme_sizes_its_buffer_like_liger():
    """Automatic chunk: Liger's chunk (next_power_of_2(N / ceil(V / D)) rows) less the rows that
    pay for the per-token loss and log-sum-exp, so that everything fits Liger's workspace; the
    vocabulary slab then fits the same buffer."""
    opts = chunks.LinearCEOptions(dw_accum="slab")
    for n, d, v in ((16384, 768, 50304), (16384, 2048, 128256), (1000, 64, 5000)):
        rows = chunks.chunk_rows_for(n, d, v, torch.bfloat16, opts)
        want = -(-n // -(-v // d))
        liger_rows = 1 << (want - 1).bit_length()
        assert rows * v * 2 + 8 * n <= liger_rows * v * 2 and rows > liger_rows // 2
        cols = chunks.slab_cols_for(n, v, rows)
        assert cols % 64 == 0 and n * cols <= rows * v


def test_lean_dw_accumulation_stays_within_per_chunk_rounding():
    """dw_accum="input": dW rounded to bf16 after each chunk. Bound: the criterion, plus two bf16
    unit roundoffs (2⁻⁸: the chunk's product, then the sum) of every partial sum held."""
    set_linear_ce_options(chunk_rows=CHUNK, dw_accum="input")
    h, w, y = _inputs(15)
    got = _run(linear_cross_entropy, h, w, y, torch.bfloat16, "mean", 0.0)
    same = _run(linear_cross_entropy_ref, h, w, y, torch.bfloat16, "mean", 0.0)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, "mean", 0.0)
    flip_dh, flip_dw = grad_rounding_atol(h, w, y, torch.bfloat16)
    assert _check(got[0], same[0], ref[0]) and _check(got[1], same[1], ref[1], flip_dh)
    assert got[2].dtype == torch.bfloat16
    h64, w64 = h.bfloat16().double(), w.bfloat16().double()
    p = torch.softmax(h64 @ w64.t(), dim=1)
    valid = y != -100
    p[valid, y[valid]] -= 1.0
    dlogits = p * valid[:, None] / valid.sum()
    partials = torch.stack([dlogits[:s].t() @ h64[:s] for s in range(CHUNK, N + CHUNK, CHUNK)])
    steps = partials.diff(dim=0, prepend=torch.zeros_like(partials[:1])).abs()
    assert _check(got[2], same[2], ref[2], flip_dw + 2.0**-8 * (partials.abs() + steps).sum(0))


def test_lean_mode_is_less_precise_than_fp32_accumulation():
    """The reason for the default: over 64 chunks, bf16 accumulation of dW (the PyTorch chunk
    path, to keep the interpreter out of a 512-token run) doubles torch's mean error; the fp32
    accumulator matches torch's."""
    controls.set_op_enabled(OP, False)
    h, w, y = _inputs(18, n=512)
    ref = _run(linear_cross_entropy_ref, h, w, y, torch.float64, "mean", 0.0)[2]
    torch_err = (_run(linear_cross_entropy_ref, h, w, y, torch.bfloat16, "mean", 0.0)[2].double() - ref).abs()
    errs = {}
    for mode in ("input", "fp32"):
        set_linear_ce_options(chunk_rows=8, dw_accum=mode)
        errs[mode] = (
            _run(linear_cross_entropy, h, w, y, torch.bfloat16, "mean", 0.0)[2].double() - ref
        ).abs()
    assert errs["input"].mean() > 1.5 * errs["fp32"].mean()
    assert errs["fp32"].mean() <= 1.05 * torch_err.mean() and errs["fp32"].max() <= 1.05 * torch_err.max()


def test_liger_handoff_rules(monkeypatch):
    h, w, y = _inputs(16)
    monkeypatch.setattr(liger, "_warned", set())
    monkeypatch.setattr(liger, "_liger", lambda: None)
    controls.set_use_liger_ce(True)
    with pytest.warns(RuntimeWarning, match="not importable"):
        loss = linear_cross_entropy(h.float(), w.float(), y)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h.float(), w.float(), y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        linear_cross_entropy(h.float(), w.float(), y)

    names = ("_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale")
    names = (*names, "label_smoothing", "reduction", "softcap", "return_z_loss", "accum_dtype")
    meta = torch.empty(2, 3, device="meta")
    cuda_like = type("T", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()
    assert (
        liger.unsupported_reason(meta, meta, "mean", True, names, (0, 8, 5)) == "the tensors are not on CUDA"
    )
    assert "accum_dtype" in liger.unsupported_reason(
        cuda_like, cuda_like, "mean", True, names[:-1], (0, 8, 5)
    )
    assert "0.8.5" in liger.unsupported_reason(cuda_like, cuda_like, "none", False, names, (0, 7, 0))
    assert liger.unsupported_reason(cuda_like, cuda_like, "none", True, names, (0, 8, 5)) is None

    def forward(  # Liger 0.8.5's signature, in short
        ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
        label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
        use_token_scaling=False,
    ):  # fmt: skip
        raise AssertionError("only the signature is used")

    given = {"_input": 1, "weight": 2, "target": 3, "ignore_index": -1, "lse_square_scale": 0.5}
    given |= {"reduction": "sum", "accum_dtype": torch.float32}
    args = liger.positional_args(forward, given)
    assert args == [1, 2, 3, None, None, -1, 0.5, 0.0, "sum", None, False, torch.float32]


def test_module_and_validation():
    h, w, y = _inputs(17)
    mod = HydraLinearCrossEntropyLoss(reduction="sum", z_loss=1e-3)
    torch.testing.assert_close(
        mod(h.float(), w.float(), y),
        linear_cross_entropy(h.float(), w.float(), y, reduction="sum", z_loss=1e-3),
    )
    assert "z_loss=0.001" in repr(mod)
    with pytest.raises(ValueError, match="reduction"):
        HydraLinearCrossEntropyLoss(reduction="avg")
    hf, wf = h.float(), w.float()
    with pytest.raises(ValueError, match="same D"):
        linear_cross_entropy(hf, wf[:, :5], y)
    with pytest.raises(ValueError, match="leading shape"):
        linear_cross_entropy(hf, wf, y[:-1])
    with pytest.raises(ValueError, match="integer class indices"):
        linear_cross_entropy(hf, wf, y.float())
    with pytest.raises(ValueError, match="dw_accum"):
        set_linear_ce_options(dw_accum="bf16")
    with pytest.raises(ValueError, match="unknown"):
        set_linear_ce_options(chunk=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vocabulary_already_aligned_takes_the_unpadded_branch(dtype):
    """V a multiple of PAD_COLS: no padded weight copy, the same fp64 criterion."""
    h, w, y = _inputs(11, v=2 * chunks.PAD_COLS)
    assert chunks.padded_cols(w.shape[0], chunks.LinearCEOptions()) == w.shape[0]
    _assert_criterion(h, w, y, dtype, "mean", 1e-3)
    assert controls.fallback_counts()[OP] == 0


def test_the_default_mode_pads_the_logits_rows_and_the_lean_modes_do_not():
    """Padding is what makes cuBLAS's fast kernels usable at an odd vocabulary (its result is
    checked against fp64 by the tests above, whose V are odd); the memory-lean modes keep their
    documented workspace."""
    opts = chunks.LinearCEOptions()
    assert chunks.padded_cols(27813, opts) == 27840 and chunks.padded_cols(32000, opts) == 32000
    for lean in ("input", "slab", "compensated"):
        assert chunks.padded_cols(27813, chunks.LinearCEOptions(dw_accum=lean)) == 27813
    w = torch.randn(5, 3, dtype=torch.float32)
    wp = chunks._padded_weight(w, torch.bfloat16, 64)
    assert wp.shape == (64, 3) and torch.equal(wp[:5], w.bfloat16()) and not wp[5:].any()
