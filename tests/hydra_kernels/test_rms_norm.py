"""rms_norm / fused_add_rms_norm: Triton kernels (interpreted on CPU) against an fp64 reference.

Every output and gradient must satisfy |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol
(hydra_kernels.numerics). Inputs are fresh random each run; the seed is in every failure message.
"""

import warnings

import pytest
import torch

from hydra_kernels import controls, fused_add_rms_norm, rms_norm
from hydra_kernels.launch_config import set_launch_overrides
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import rms_norm as rms_mod
from hydra_kernels.ops.rms_norm import (
    FWD_TABLES,
    MAX_FUSED_DIM,
    fused_add_rms_norm_ref,
    rms_norm_backward_ref,
    rms_norm_ref,
)

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _randn(*shape, dtype=torch.float32, grad=True):
    t = torch.randn(*shape, device=DEVICE).to(dtype)
    return t.requires_grad_(grad)


def _weight(dim, dtype=torch.float32):
    return (1.0 + 0.3 * torch.randn(dim, device=DEVICE)).to(dtype).requires_grad_()


def _run(fn, inputs, upstream):
    """Outputs of fn(*inputs) and the gradients of Σ out·upstream w.r.t. every input."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream, strict=True))
    return outs, torch.autograd.grad(loss, inputs)


def _as64(inputs):
    return [t.detach().double().requires_grad_() for t in inputs]


def _check_all(fn, ref_fn, inputs, upstream, seed, names, reduction="elementwise"):
    """Kernel vs torch-in-same-dtype vs fp64 on every output and gradient."""
    k_out, k_grads = _run(fn, inputs, upstream)
    t_out, t_grads = _run(ref_fn, inputs, upstream)
    r_out, r_grads = _run(ref_fn, _as64(inputs), upstream)
    for name, k, t, r in zip(names, (*k_out, *k_grads), (*t_out, *t_grads), (*r_out, *r_grads), strict=True):
        assert k.dtype == t.dtype and k.shape == t.shape, f"{name}: {k.dtype}{tuple(k.shape)} vs {t.dtype}"
        # atol: 16 fp32 ulps of the value's scale — the kernel sums in another order (and rsqrt is
        # approximate on GPUs); where torch's own error is ~0 that noise alone must not fail.
        res = check_against_fp64(k, t, r, atol=fp32_noise_atol(r), reduction=reduction)
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    return k_out, k_grads


def _assert_kernel_ran(out):
    assert "RMSNorm" in type(out.grad_fn).__name__, f"reference ran instead: {out.grad_fn}"
    assert controls.fallback_counts()["rms_norm"] == 0


@pytest.mark.parametrize(
    ("shape", "dtype", "x_scale"),
    [
        ((37, 96), torch.float32, 1.0),
        ((37, 96), torch.bfloat16, 1.0),
        ((3, 11, 200), torch.bfloat16, 1.0),
        ((2, 5, 200), torch.float16, 1.0),
        ((6, 768), torch.float32, 1.0),
        ((301, 72), torch.bfloat16, 1.0),  # many row blocks per program in the persistent backward
        ((21, 96), torch.float32, 1e-3),  # mean(x²) ≈ eps: a wrong epsilon shows
        ((21, 96), torch.bfloat16, 1e-3),
    ],
)
def test_rms_norm_matches_fp64(shape, dtype, x_scale, seed):
    x = (x_scale * torch.randn(*shape, device=DEVICE)).to(dtype).requires_grad_()
    w = _weight(shape[-1], dtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    (y,), _ = _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    _assert_kernel_ran(y)


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_rms_norm_mixed_weight_dtype(x_dtype, w_dtype, seed):
    """Defined behaviour: output and dx in x's dtype, dW in the weight's dtype, fp32 math."""
    x, w = _randn(4, 9, 200, dtype=x_dtype), _weight(200, w_dtype)
    dy = torch.randn(x.shape, device=DEVICE).to(x_dtype)
    (y,), (dx, dw) = _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    assert (y.dtype, dx.dtype, dw.dtype) == (x_dtype, x_dtype, w_dtype)


def test_rms_norm_strided_input(seed):
    base = _randn(11, 3, 2 * 96, grad=False)
    x = base.transpose(0, 1)[..., ::2].detach().requires_grad_()  # neither rows nor columns contiguous
    assert not x.is_contiguous()
    w, dy = _weight(96), torch.randn(3, 11, 96, device=DEVICE)
    (y,), _ = _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    _assert_kernel_ran(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_matches_fp64(dtype, seed):
    x, res, w = _randn(5, 7, 200, dtype=dtype), _randn(5, 7, 200, dtype=dtype), _weight(200)
    up = (torch.randn(x.shape, device=DEVICE).to(dtype), torch.randn(x.shape, device=DEVICE).to(dtype))
    names = ("normed", "summed", "dx", "dresidual", "dw")
    # In bf16 the op rounds x + residual before normalising; kernel and torch share that error and
    # torch's own later roundings cancel it at single elements by chance: compare max errors there.
    reduction = "elementwise" if dtype == torch.float32 else "max"
    (normed, summed), _ = _check_all(
        fused_add_rms_norm, fused_add_rms_norm_ref, (x, res, w), up, seed, names, reduction
    )
    _assert_kernel_ran(normed)
    # normed is the norm of exactly the sum it returns: both round the same fp32 value to the output
    # dtype, so in bf16 they differ only where fp32 reordering noise straddles a rounding boundary,
    # by one bf16 ulp there (seen: 1 element of 7000 for one seed), and are equal elsewhere
    ref, atol = rms_norm_ref(summed, w), fp32_noise_atol(normed) * 64
    if dtype == torch.float32:
        torch.testing.assert_close(normed, ref, rtol=0, atol=atol)
    else:
        diff = (normed.float() - ref.float()).abs()
        one_ulp = torch.finfo(dtype).eps * ref.float().abs()  # ≥ one ulp at each element's magnitude
        assert (diff <= one_ulp + atol).all(), float(diff.max())
        assert float((diff == 0).float().mean()) >= 0.99


@pytest.mark.parametrize("used", ["normed", "summed"])
def test_fused_add_one_output_used(used, seed):
    x, res, w = _randn(9, 96), _randn(9, 96), _weight(96)
    pick = 0 if used == "normed" else 1
    up = torch.randn(9, 96, device=DEVICE)
    k = torch.autograd.grad(fused_add_rms_norm(x, res, w)[pick], (x, res, w), up, allow_unused=True)
    inputs64 = _as64((x, res, w))
    r = torch.autograd.grad(fused_add_rms_norm_ref(*inputs64)[pick], inputs64, up.double(), allow_unused=True)
    for name, kg, rg in zip(("dx", "dresidual", "dw"), k, r, strict=True):
        if rg is None:  # weight unused when only the sum is: zero or None are both right
            assert kg is None or not kg.any(), name
        else:
            torch.testing.assert_close(kg.double(), rg, rtol=1e-5, atol=1e-5, msg=f"{name} seed={seed}")


def test_fused_add_mixed_dtypes(seed):
    """bf16 branch output onto an fp32 residual stream: both outputs fp32, grads in input dtypes."""
    x, res, w = _randn(6, 96, dtype=torch.bfloat16), _randn(6, 96), _weight(96)
    up = (torch.randn(6, 96, device=DEVICE), torch.randn(6, 96, device=DEVICE))
    names = ("normed", "summed", "dx", "dresidual", "dw")
    outs, grads = _check_all(fused_add_rms_norm, fused_add_rms_norm_ref, (x, res, w), up, seed, names)
    assert [t.dtype for t in (*outs, *grads)] == [torch.float32] * 2 + [
        torch.bfloat16,
        torch.float32,
        torch.float32,
    ]


def test_backward_switch_off_uses_pytorch_backward(monkeypatch, seed):
    calls = {"fwd": 0}
    real_fwd = rms_mod.rms_norm_fwd_launch

    def counting_fwd(*args):
        calls["fwd"] += 1
        return real_fwd(*args)

    def no_bwd(*args):
        raise AssertionError("the Triton backward ran although switched off")

    monkeypatch.setattr(rms_mod, "rms_norm_fwd_launch", counting_fwd)
    monkeypatch.setattr(rms_mod, "rms_norm_bwd_launch", no_bwd)
    controls.set_op_enabled("rms_norm", True, backward=False)
    x, w = _randn(13, 200, dtype=torch.bfloat16), _weight(200)
    dy = torch.randn(13, 200, device=DEVICE).to(torch.bfloat16)
    _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    res = _randn(13, 200, dtype=torch.bfloat16)
    _check_all(
        fused_add_rms_norm,
        fused_add_rms_norm_ref,
        (x, res, w),
        (dy, dy),
        seed,
        ("normed", "summed", "dx", "dres", "dw"),
        "max",
    )  # bf16 sum: see test_fused_add_matches_fp64
    assert calls["fwd"] == 2
    assert controls.fallback_counts()["rms_norm"] == 0


def test_kernels_switched_off_run_reference(monkeypatch, seed):
    def no_kernel(*args):
        raise AssertionError("a Triton launcher ran although kernels are off")

    monkeypatch.setattr(rms_mod, "rms_norm_fwd_launch", no_kernel)
    monkeypatch.setattr(rms_mod, "rms_norm_bwd_launch", no_kernel)
    x, w = _randn(5, 96), _weight(96)
    dy = torch.randn(5, 96, device=DEVICE)
    for switch_off, switch_on in (
        (lambda: controls.set_use_triton_kernels(False), lambda: controls.set_use_triton_kernels(True)),
        (
            lambda: controls.set_op_enabled("rms_norm", False),
            lambda: controls.set_op_enabled("rms_norm", True),
        ),
    ):
        switch_off()
        _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
        switch_on()
    assert controls.fallback_counts()["rms_norm"] == 0


@pytest.mark.fallback_expected
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_triton_failure_falls_back_counted_and_warned_once(stage, monkeypatch, seed):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(
        rms_mod, "rms_norm_fwd_launch" if stage == "forward" else "rms_norm_bwd_launch", broken
    )
    x, w = _randn(7, 96), _weight(96)
    dy = torch.randn(7, 96, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="simulated kernel failure"):
        _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    assert controls.fallback_counts()["rms_norm"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is counted, not warned again
        _check_all(rms_norm, rms_norm_ref, (x, w), (dy,), seed, ("y", "dx", "dw"))
    assert controls.fallback_counts()["rms_norm"] == 2
    assert "simulated" in controls.get_kernel_status()["ops"]["rms_norm"]["last_error"]


@pytest.mark.fallback_expected
def test_too_wide_rows_fall_back_visibly(seed):
    x, w = _randn(2, MAX_FUSED_DIM + 1), _weight(MAX_FUSED_DIM + 1)
    with pytest.warns(RuntimeWarning, match="exceed"):
        y = rms_norm(x, w)
    torch.testing.assert_close(y, rms_norm_ref(x, w))
    assert controls.fallback_counts()["rms_norm"] == 1


def test_pytorch_backward_formula_matches_autograd(seed):
    """The hand-written backward used when the fused one is off, against fp64 autograd."""
    x, w, ds = _randn(6, 200).double(), _weight(200).double(), torch.randn(6, 200, device=DEVICE).double()
    dy = torch.randn(6, 200, device=DEVICE).double()
    dx, dw = rms_norm_backward_ref(dy, x, w, 1e-6, ds)
    rx, rw = torch.autograd.grad(rms_norm_ref(x, w), (x, w), dy)
    torch.testing.assert_close(dx.double(), rx + ds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-5, atol=1e-6)


def test_no_input_or_incoming_gradient_is_overwritten(seed):
    """dy also feeds another branch (p's gradient) and x, w, residual are read again afterwards:
    all must be untouched by the kernels."""
    x, res, w = _randn(9, 96), _randn(9, 96), _weight(96)
    p = torch.zeros(9, 96, device=DEVICE, requires_grad=True)
    up = torch.randn(9, 96, device=DEVICE)
    saved = [t.detach().clone() for t in (x, res, w, up)]
    normed, summed = fused_add_rms_norm(x, res, w)
    out = rms_norm(summed, w) + p + normed  # the gradient reaching both norms is p's gradient too
    out.backward(up)
    torch.testing.assert_close(p.grad, up, rtol=0, atol=0)
    for before, after in zip(saved, (x, res, w, up), strict=True):
        assert torch.equal(before, after.detach())
    # and the gradients are right
    x64, r64, w64, p64 = _as64((x, res, w, p))
    n64, s64 = fused_add_rms_norm_ref(x64, r64, w64)
    (rms_norm_ref(s64, w64) + p64 + n64).backward(up.double())
    for k, r in ((x.grad, x64.grad), (res.grad, r64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(k.double(), r, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")


@pytest.mark.parametrize("leaves", ["both", "x only"])
def test_fused_add_leaf_gradients_are_right_and_unaliased(leaves, seed):
    """With leaves, the backward kernel writes the residual's gradient as a second copy (instead
    of autograd cloning the shared one): both must hold the right values in separate memory, so
    that accumulating into one (the next micro-batch, an in-place clip) leaves the other alone."""
    x, res, w = _randn(11, 200, dtype=torch.bfloat16), _randn(11, 200, dtype=torch.bfloat16), _weight(200)
    if leaves == "x only":
        res = (res.detach() * 1.0).requires_grad_()  # a non-leaf: its gradient flows into the graph
        res_leaf = res
        res = res_leaf * 1.0
    up = (
        torch.randn(11, 200, device=DEVICE).to(torch.bfloat16),
        torch.randn(11, 200, device=DEVICE).to(torch.bfloat16),
    )
    normed, summed = fused_add_rms_norm(x, res, w)
    torch.autograd.backward((normed, summed), up)
    g_res = (res_leaf if leaves == "x only" else res).grad
    assert x.grad is not None and g_res is not None
    assert x.grad.data_ptr() != g_res.data_ptr()
    x64, r64, w64 = _as64((x, res, w))
    n64, s64 = fused_add_rms_norm_ref(x64, r64, w64)
    torch.autograd.backward((n64, s64), tuple(u.double() for u in up))
    atol = 2 * float(x64.grad.abs().max()) * 2**-8  # bf16 results: two bf16 ulps at the largest value
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=atol, msg=f"seed={seed}")
    torch.testing.assert_close(g_res.double(), x64.grad, rtol=0, atol=atol, msg=f"seed={seed}")
    before = g_res.clone()
    x.grad.mul_(3.0)  # in place on one gradient
    assert torch.equal(g_res, before)


def test_double_backward_raises_instead_of_returning_wrong_values():
    """The kernels' backward is first-order only: with create_graph=True the result must refuse
    a second differentiation, not silently drop its terms."""
    x, w = _randn(5, 96), _weight(96)
    (dx,) = torch.autograd.grad(rms_norm(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


def test_empty_input():
    x, w = torch.empty(0, 96, device=DEVICE, requires_grad=True), _weight(96)
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 96) and dx.shape == (0, 96) and not dw.any()


def test_weight_shape_is_checked():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(3, 8), torch.ones(9))


def test_launch_overrides_apply_and_stay_correct(seed):
    set_launch_overrides("rms_norm", block_rows=2, num_warps=2)
    widest, table = FWD_TABLES[0]
    cfg = rms_mod.launch_config_for("rms_norm", DEVICE, widest, FWD_TABLES)
    assert (cfg.block_rows, cfg.num_warps) == (2, 2) and table["default"].block_rows != 2
    x, w = _randn(9, 96), _weight(96)
    _check_all(rms_norm, rms_norm_ref, (x, w), (torch.randn(9, 96, device=DEVICE),), seed, ("y", "dx", "dw"))
    assert controls.fallback_counts()["rms_norm"] == 0


def test_custom_ops_pass_opcheck():
    x, w = _randn(5, 40), _weight(40)
    torch.library.opcheck(rms_mod._rms_norm_fwd_op, (x, w, 1e-6))
    torch.library.opcheck(rms_mod._fused_add_fwd_op, (x, _randn(5, 40), w, 1e-6))
    dy = torch.randn(5, 40, device=x.device)  # on x's device: the GPU run's inputs too
    torch.library.opcheck(rms_mod._rms_norm_bwd_op, (dy, x.detach(), w.detach(), 1e-6, None))


def test_compile_fullgraph_no_graph_break(monkeypatch, seed):
    import torch._dynamo

    calls = {"bwd": 0}
    real_bwd = rms_mod.rms_norm_bwd_launch

    def counting_bwd(*args):
        calls["bwd"] += 1
        return real_bwd(*args)

    monkeypatch.setattr(rms_mod, "rms_norm_bwd_launch", counting_bwd)

    def block(x, res, w):
        normed, summed = fused_add_rms_norm(x, res, w)
        return rms_norm(normed * 2.0, w), summed

    x, res, w = _randn(9, 96), _randn(9, 96), _weight(96)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x, res, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    up = (torch.randn(9, 96, device=DEVICE), torch.randn(9, 96, device=DEVICE))
    k_out, k_grads = _run(compiled, (x, res, w), up)
    assert calls["bwd"] == 2  # both norms' backward ran the Triton kernel inside the compiled graph
    e_out, e_grads = _run(block, (x, res, w), up)
    for k, e in zip((*k_out, *k_grads), (*e_out, *e_grads), strict=True):
        torch.testing.assert_close(k, e, rtol=0, atol=0)  # same kernels, same order: bitwise equal
    torch._dynamo.reset()


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    from hydra_kernels.ops import rms_norm as rms

    bf, f32 = "*bf16", "*fp32"
    fwd = {"X": bf, "RES": bf, "W": f32, "Y": bf, "SUM": bf, "n_rows": "i32", "stride_x": "i32",
           "stride_res": "i32", "eps": "fp32"}  # fmt: skip
    consts = {"N_COLS": 768, "BLOCK_D": 1024, "BLOCK_ROWS": 4, "HAS_RESIDUAL": True}
    build_sm90(rms._rms_norm_fwd_kernel, fwd, consts, 4, 2)
    bwd = {"DY": bf, "X": bf, "W": f32, "DSUM": bf, "DX": bf, "DRES": bf, "DW_PARTIAL": f32, "n_rows": "i32",
           "stride_dy": "i32", "stride_x": "i32", "stride_dsum": "i32", "eps": "fp32"}  # fmt: skip
    consts = {
        "N_COLS": 4096,
        "BLOCK_D": 4096,
        "BLOCK_ROWS": 1,
        "ITERS": 16,
        "HAS_DSUM": True,
        "HAS_DRES": True,
        "LOOP_STAGES": 3,
    }
    compiled = build_sm90(rms._rms_norm_bwd_kernel, bwd, consts, 8, 3)
    assert "cp.async" in compiled.asm["ptx"], "the backward's row loop is not pipelined"
    consts = {"N_COLS": 768, "BLOCK_P": 32, "BLOCK_C": 64, "P_ITERS": 4}
    build_sm90(rms._dw_reduce_kernel, {"PARTIAL": f32, "DW": bf, "n_partials": "i32"}, consts, 4, 2)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler; compile for sm_90 here so that GPU-only errors
    (and a row loop that stopped being pipelined) show on a CPU-only machine too."""
    assert_compiles_for_sm90(__file__)
