"""qk_norm: Triton kernels (interpreted on CPU) against an fp64 reference.

Every output and gradient must satisfy |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol
(hydra_kernels.numerics). Inputs are fresh random each run; the seed is in every failure message.
"""

import math
import warnings

import pytest
import torch

from hydra_kernels import controls, qk_norm
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import qk_norm as qk_mod
from hydra_kernels.ops.qk_norm import NORM_EPS, qk_norm_backward_ref, qk_norm_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _inputs(shape, dtype, with_temp, temp_dtype=torch.float32):
    x = torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()
    temp = (
        (0.4 * torch.randn(shape[-2], device=DEVICE)).to(temp_dtype).requires_grad_() if with_temp else None
    )
    return x, temp


def _run(x, temp, scale, upstream, fn):
    inputs = (x,) if temp is None else (x, temp)
    y = fn(x, scale, temp)
    return (y, *torch.autograd.grad((y.double() * upstream.double()).sum(), inputs))


def _check(x, temp, scale, upstream, seed, row_masks=None):
    """Kernel vs torch-in-same-dtype vs fp64 for y, dx (and dtemperature)."""
    k = _run(x, temp, scale, upstream, qk_norm)
    t = _run(x, temp, scale, upstream, qk_norm_ref)
    x64 = x.detach().double().requires_grad_()
    t64 = temp.detach().double().requires_grad_() if temp is not None else None
    r = _run(x64, t64, scale, upstream, qk_norm_ref)
    names = ("y", "dx", "dtemperature")
    for name, kv, tv, rv in zip(names, k, t, r, strict=False):  # no dtemperature without temperature
        assert kv.dtype == tv.dtype and kv.shape == tv.shape, f"{name}: {kv.dtype} vs {tv.dtype}"
        # Rows of very different scale (all-zero heads have 1/eps gradients) are checked apart so
        # that one's atol cannot hide the other's errors.
        masks = row_masks if (row_masks is not None and name != "dtemperature") else [None]
        for mask in masks:
            kv_, tv_, rv_ = (v if mask is None else v[mask] for v in (kv, tv, rv))
            # atol: 16 fp32 ulps of the value's scale, for summation-order noise where torch's own
            # error happens to be ~0.
            res = check_against_fp64(kv_, tv_, rv_, atol=fp32_noise_atol(rv_))
            assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert "QKNorm" in type(k[0].grad_fn).__name__, f"reference ran instead: {k[0].grad_fn}"
    return k


@pytest.mark.parametrize(
    ("shape", "dtype", "with_temp"),
    [
        ((2, 9, 3, 64), torch.float32, False),
        ((2, 9, 3, 64), torch.bfloat16, True),
        ((1, 7, 5, 72), torch.bfloat16, True),  # head dim not a power of two
        ((2, 5, 4, 128), torch.float16, True),
        ((3, 50, 2, 64), torch.bfloat16, True),  # several row blocks per backward program
        ((11, 6, 40), torch.float32, True),  # one leading dim
    ],
)
def test_qk_norm_matches_fp64(shape, dtype, with_temp, seed):
    x, temp = _inputs(shape, dtype, with_temp)
    upstream = torch.randn(shape, device=DEVICE).to(dtype)
    _check(x, temp, math.sqrt(shape[-1]), upstream, seed)
    assert controls.fallback_counts()["qk_norm"] == 0


def test_strided_view_of_packed_projection(seed):
    """q and k sliced out of one packed [B, S, (Hq + Hk)·d] tensor are strided views."""
    b, s, hq, hk, d = 2, 7, 3, 2, 64
    packed = torch.randn(b, s, (hq + hk) * d, device=DEVICE).to(torch.bfloat16)
    q = packed[..., : hq * d].unflatten(-1, (hq, d)).detach().requires_grad_()
    k = packed[..., hq * d :].unflatten(-1, (hk, d)).detach().requires_grad_()
    assert not q.is_contiguous() and not k.is_contiguous()
    for x in (q, k):
        _, temp = _inputs(x.shape, torch.bfloat16, True)
        # the upstream gradient is a strided view too
        upstream = torch.randn(b, x.shape[2], s, d, device=DEVICE).to(torch.bfloat16).transpose(1, 2)
        _check(x, temp, math.sqrt(d), upstream, seed)


def test_mixed_temperature_dtype(seed):
    x, temp = _inputs((2, 6, 4, 64), torch.bfloat16, True, temp_dtype=torch.float32)
    y, dx, dtemp = _check(x, temp, 8.0, torch.randn(2, 6, 4, 64, device=DEVICE).to(torch.bfloat16), seed)
    assert (y.dtype, dx.dtype, dtemp.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_and_tiny_heads_are_guarded_like_the_reference(dtype, seed):
    x = torch.randn(3, 5, 4, 64, device=DEVICE)
    x[0, 1, 2] = 0.0  # all-zero head: clamp active, output 0
    x[2, 3, 0] = 0.0
    x[1, 4, 1] *= 1e-8  # ‖x‖ below NORM_EPS: clamp active, non-zero input
    x = x.to(dtype).requires_grad_()
    _, temp = _inputs(x.shape, dtype, True)
    norms = x.detach().float().norm(dim=-1)
    guarded = norms < NORM_EPS
    assert guarded.sum() == 3
    y, *_ = _check(x, temp, 8.0, torch.randn(x.shape, device=DEVICE).to(dtype), seed, [guarded, ~guarded])
    assert torch.isfinite(y).all() and not y[0, 1, 2].any()


def test_backward_switch_off_uses_pytorch_backward(monkeypatch, seed):
    def no_bwd(*args):
        raise AssertionError("the Triton backward ran although switched off")

    monkeypatch.setattr(qk_mod, "qk_norm_bwd_launch", no_bwd)
    controls.set_op_enabled("qk_norm", True, backward=False)
    x, temp = _inputs((2, 9, 3, 64), torch.bfloat16, True)
    _check(x, temp, 8.0, torch.randn(x.shape, device=DEVICE).to(torch.bfloat16), seed)
    assert controls.fallback_counts()["qk_norm"] == 0


def test_kernels_switched_off_run_reference(monkeypatch):
    def no_kernel(*args):
        raise AssertionError("a Triton launcher ran although kernels are off")

    monkeypatch.setattr(qk_mod, "qk_norm_fwd_launch", no_kernel)
    monkeypatch.setattr(qk_mod, "qk_norm_bwd_launch", no_kernel)
    controls.set_op_enabled("qk_norm", False)
    x, temp = _inputs((2, 3, 2, 64), torch.float32, True)
    y = qk_norm(x, 8.0, temp)
    torch.testing.assert_close(y, qk_norm_ref(x, 8.0, temp), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and temp.grad is not None


@pytest.mark.fallback_expected
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_triton_failure_falls_back_counted_and_warned_once(stage, monkeypatch, seed):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(qk_mod, "qk_norm_fwd_launch" if stage == "forward" else "qk_norm_bwd_launch", broken)
    x, temp = _inputs((2, 5, 3, 64), torch.float32, True)
    up = torch.randn(x.shape, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="simulated kernel failure"):
        _check(x, temp, 8.0, up, seed)
    assert controls.fallback_counts()["qk_norm"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(x, temp, 8.0, up, seed)
    assert controls.fallback_counts()["qk_norm"] == 2


def test_pytorch_backward_formula_matches_autograd(seed):
    x = torch.randn(4, 3, 40, dtype=torch.float64, device=DEVICE)
    x[1, 2] = 0.0
    temp = 0.3 * torch.randn(3, dtype=torch.float64, device=DEVICE)
    dy = torch.randn_like(x)
    dx, dtemp = qk_norm_backward_ref(dy, x, 5.0, temp)
    x_, t_ = x.clone().requires_grad_(), temp.clone().requires_grad_()
    rx, rt = torch.autograd.grad(qk_norm_ref(x_, 5.0, t_), (x_, t_), dy)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    torch.testing.assert_close(dtemp, rt, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


def test_incoming_gradient_and_inputs_are_not_overwritten(seed):
    x, temp = _inputs((2, 4, 3, 64), torch.float32, True)
    p = torch.zeros(x.shape, device=DEVICE, requires_grad=True)
    up = torch.randn(x.shape, device=DEVICE)
    saved = [t.detach().clone() for t in (x, temp, up)]
    (qk_norm(x, 8.0, temp) + p).backward(up)  # the gradient reaching qk_norm is p's gradient too
    torch.testing.assert_close(p.grad, up, rtol=0, atol=0)
    for before, after in zip(saved, (x, temp, up), strict=True):
        assert torch.equal(before, after.detach())


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="temperature has shape"):
        qk_norm(torch.randn(2, 3, 4, 8), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match=r"\[\.\.\., H, D\]"):
        qk_norm(torch.randn(8), 1.0)


def test_custom_ops_pass_opcheck():
    x, temp = _inputs((2, 3, 2, 16), torch.float32, True)
    torch.library.opcheck(qk_mod._qk_norm_fwd_op, (x, 4.0, temp))
    torch.library.opcheck(qk_mod._qk_norm_fwd_op, (x, 4.0, None))
    dy = torch.randn(x.shape, device=x.device)  # on x's device: the GPU run's inputs too
    torch.library.opcheck(qk_mod._qk_norm_bwd_op, (dy, x.detach(), 4.0, temp.detach()))


def test_compile_fullgraph_no_graph_break(seed):
    import torch._dynamo

    def attention_prologue(q, k, temp):
        return qk_norm(q, 8.0), qk_norm(k, 8.0, temp)

    q, _ = _inputs((2, 5, 4, 64), torch.float32, False)
    k, temp = _inputs((2, 5, 2, 64), torch.float32, True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(attention_prologue)(q, k, temp)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(attention_prologue, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, attention_prologue):
        qn, kn = fn(q, k, temp)
        results.append((qn, kn, *torch.autograd.grad(qn.sum() + (kn * kn).sum(), (q, k, temp))))
    for c, e in zip(*results, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)  # same kernels either way: bitwise equal
    torch._dynamo.reset()


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below): the kernels alone and
    with RoPE fused (HALF > 0: ops/qk_norm_rope.py)."""
    bf, f32 = "*bf16", "*fp32"
    fwd = {"X": bf, "TEMP": f32, "COS": f32, "SIN": f32, "Y": bf, "n_rows": "i32", "stride_t": "i32",
           "stride_h": "i32", "seq_len": "i32", "stride_tb": "i32", "stride_ts": "i32", "scale": "fp32",
           "eps_sq": "fp32"}  # fmt: skip
    bwd = {"DY": bf, "X": bf, "TEMP": f32, "COS": f32, "SIN": f32, "DX": bf, "DT_PARTIAL": f32,
           "n_rows": "i32", "stride_dyt": "i32", "stride_dyh": "i32", "stride_xt": "i32",
           "stride_xh": "i32", "seq_len": "i32", "stride_tb": "i32", "stride_ts": "i32", "scale": "fp32",
           "eps_sq": "fp32"}  # fmt: skip
    for half in (0, 16):
        consts = {"N_HEADS": 6, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_ROWS": 32, "HAS_TEMP": True,
                  "HALF": half}  # fmt: skip
        build_sm90(qk_mod._qk_norm_fwd_kernel, fwd, consts, 4, 2)
        consts = {"N_HEADS": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_ROWS": 16, "BLOCK_H": 16,
                  "ITERS": 16, "HAS_TEMP": True, "LOOP_STAGES": 3, "HALF": 4 * half}  # fmt: skip
        compiled = build_sm90(qk_mod._qk_norm_bwd_kernel, bwd, consts, 4, 3)
        assert "cp.async" in compiled.asm["ptx"], f"the backward's row loop is not pipelined (HALF={half})"


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler; compile for sm_90 here so that GPU-only errors
    (and a row loop that stopped being pipelined) show on a CPU-only machine too."""
    assert_compiles_for_sm90(__file__)
