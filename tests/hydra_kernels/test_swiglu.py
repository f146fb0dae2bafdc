"""swiglu / swiglu_packed / HydraSwiGLUMLP: Triton kernels (interpreted on CPU) against fp64.

Every output and gradient must satisfy |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol
(hydra_kernels.numerics). Inputs are fresh random each run; the seed is in every failure message.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from hydra_kernels import HydraSwiGLUMLP, controls, swiglu, swiglu_packed
from hydra_kernels.launch_config import set_launch_overrides
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import swiglu as sw
from hydra_kernels.ops.swiglu import swiglu_ref

from .conftest import DEVICE, NEEDS_TRITON, sm90_access_counts

pytestmark = NEEDS_TRITON


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE)).to(dtype).requires_grad_()


def _outs_and_grads(fn, inputs, upstream):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, upstream)


def _as64(inputs):
    return [t.detach().double().requires_grad_() for t in inputs]


def _check(fn, ref, inputs, upstream, seed, names):
    """fn (kernel) vs ref in the same dtype vs ref in fp64, on the same rounded inputs."""
    k = _outs_and_grads(fn, inputs, upstream)
    t = _outs_and_grads(ref, inputs, upstream)
    r = _outs_and_grads(ref, _as64(inputs), upstream.double())
    for name, kv, tv, rv in zip(names, (k[0], *k[1]), (t[0], *t[1]), (r[0], *r[1]), strict=True):
        assert kv.dtype == tv.dtype and kv.shape == tv.shape, name
        res = check_against_fp64(kv, tv, rv, atol=fp32_noise_atol(rv))
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    return k


def _ran_kernel(out: torch.Tensor) -> bool:
    return "SwiGLU" in type(out.grad_fn).__name__ and controls.fallback_counts()["swiglu"] == 0


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((37, 96), torch.float32),
        ((3, 11, 200), torch.bfloat16),
        ((2, 5, 77), torch.float16),
        ((4099,), torch.bfloat16),
    ],
)
def test_swiglu_matches_fp64(shape, dtype, seed):
    gate, up = _rand(*shape, dtype=dtype, scale=3.0), _rand(*shape, dtype=dtype)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    out, _ = _check(swiglu, swiglu_ref, (gate, up), dy, seed, ("y", "dgate", "dup"))
    assert _ran_kernel(out)


def test_swiglu_halves_of_one_projection_are_read_in_place(seed):
    h = _rand(3, 13, 2 * 100, dtype=torch.bfloat16, scale=2.0)
    gate, up = h[..., :100], h[..., 100:]
    rows = sw._rows(gate, 100)
    assert rows.data_ptr() == gate.data_ptr() and rows.stride() == (200, 1)  # a view, no copy
    dy = torch.randn(3, 13, 100, device=DEVICE).to(torch.bfloat16)
    out, _ = _check(swiglu, swiglu_ref, (gate, up), dy, seed, ("y", "dgate", "dup"))
    assert _ran_kernel(out) and out.is_contiguous()


def test_swiglu_without_unit_last_stride_is_copied_and_correct(seed):
    base = _rand(7, 2 * 45, scale=2.0)
    gate, up = base[:, ::2], base[:, 1::2]  # last stride 2: the launcher copies
    dy = torch.randn(7, 45, device=DEVICE)
    out, _ = _check(swiglu, swiglu_ref, (gate, up), dy, seed, ("y", "dgate", "dup"))
    assert _ran_kernel(out)


def test_many_column_blocks_per_row(seed):
    set_launch_overrides("swiglu", block_q=32)  # 100 columns -> 4 blocks per row, ragged tail
    h = _rand(5, 200, scale=2.0)
    dy = torch.randn(5, 100, device=DEVICE)
    out, _ = _check(swiglu, swiglu_ref, (h[:, :100], h[:, 100:]), dy, seed, ("y", "dgate", "dup"))
    assert _ran_kernel(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_packed_matches_fp64(dtype, seed):
    gu = _rand(2, 9, 2 * 61, dtype=dtype, scale=2.0)
    dy = torch.randn(2, 9, 61, device=DEVICE).to(dtype)

    def ref(t):
        return swiglu_ref(t[..., :61], t[..., 61:])

    out, (grad,) = _check(swiglu_packed, ref, (gu,), dy, seed, ("y", "dgate_up"))
    assert _ran_kernel(out) and grad.shape == gu.shape and grad.is_contiguous()


def test_hydra_swiglu_mlp_matches_fp64_math(seed):
    mlp = HydraSwiGLUMLP(40, 72).to(DEVICE)
    assert mlp.gate_up_proj.weight.shape == (144, 40) and mlp.down_proj.weight.shape == (40, 72)
    x = torch.randn(3, 5, 40, device=DEVICE)
    y = mlp(x)
    y.backward(torch.ones_like(y))
    w_gu, w_d = mlp.gate_up_proj.weight.detach().double(), mlp.down_proj.weight.detach().double()
    w64 = w_gu.clone().requires_grad_()
    h = x.double() @ w64.t()
    ref = (F.silu(h[..., :72]) * h[..., 72:]) @ w_d.t()
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    torch.testing.assert_close(mlp.gate_up_proj.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)
    assert controls.fallback_counts()["swiglu"] == 0
    assert HydraSwiGLUMLP(768).hidden_dim == 2048  # 8/3·768 rounded up to a multiple of 64
    with pytest.raises(ValueError, match="hidden_dim"):
        HydraSwiGLUMLP(8, 0)


def test_compile_fullgraph_has_no_graph_breaks(seed):
    def f(h, a, b):
        return swiglu_packed(h).sum() + (swiglu(a, b) * 2).sum()

    h, a, b = _rand(3, 2 * 24), _rand(5, 17), _rand(5, 17)
    explained = torch._dynamo.explain(f)(h, a, b)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(h, a, b), (h, a, b))
    want = torch.autograd.grad(f(h, a, b), (h, a, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert controls.fallback_counts()["swiglu"] == 0


def test_switched_off_runs_the_reference(seed):
    controls.set_use_triton_kernels(False)
    gate, up = _rand(4, 33), _rand(4, 33)
    out = swiglu(gate, up)
    assert "SwiGLU" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, swiglu_ref(gate, up), rtol=0, atol=0)


def test_backward_switch_off_uses_pytorch_backward(seed, monkeypatch):
    controls.set_op_enabled("swiglu", True, backward=False)

    def must_not_run(*args):
        raise AssertionError("the fused backward ran although it is switched off")

    monkeypatch.setattr(sw, "_launch_swiglu_bwd", must_not_run)
    gate, up = _rand(6, 50, dtype=torch.bfloat16, scale=3.0), _rand(6, 50, dtype=torch.bfloat16)
    dy = torch.randn(6, 50, device=DEVICE).to(torch.bfloat16)
    out, _ = _check(swiglu, swiglu_ref, (gate, up), dy, seed, ("y", "dgate", "dup"))
    assert _ran_kernel(out)  # forward still fused, and nothing fell back


@pytest.mark.fallback_expected
@pytest.mark.parametrize("which", ["_launch_swiglu_fwd", "_launch_swiglu_bwd", "_launch_swiglu_packed_bwd"])
def test_kernel_failure_falls_back_counted_and_warned_once(which, seed, monkeypatch):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(sw, which, broken)
    fn = swiglu_packed if "packed" in which else swiglu
    gu = _rand(3, 2 * 20, scale=2.0)
    inputs = (gu,) if fn is swiglu_packed else (gu[:, :20], gu[:, 20:])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = fn(*inputs)
            (grad,) = torch.autograd.grad(out.sum(), gu)
    ref_out = swiglu_ref(gu[:, :20], gu[:, 20:])
    (ref_grad,) = torch.autograd.grad(ref_out.sum(), gu)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert controls.fallback_counts()["swiglu"] == 2
    failures = [w for w in caught if "simulated kernel failure" in str(w.message)]
    assert len(failures) == 1 and issubclass(failures[0].category, RuntimeWarning)


def test_float64_and_empty_and_bad_inputs():
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(swiglu(a, b), F.silu(a) * b, rtol=1e-15, atol=1e-15)  # fp64 reference
    empty = swiglu(torch.empty(0, 8, device=DEVICE), torch.empty(0, 8, device=DEVICE))
    assert empty.shape == (0, 8)
    with pytest.raises(ValueError, match="differ in shape"):
        swiglu(torch.randn(2, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match="one dtype"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be even"):
        swiglu_packed(torch.randn(2, 7))


def test_row_block_limits_padding():
    for width in (1, 100, 1000, 2048, 5440, 5443, 10880, 2**25):
        for max_block in (1024, 4096, 8192):
            b = sw.row_block(width, max_block)
            assert b & (b - 1) == 0 and 16 <= b <= max_block
            padded = -(-width // b) * b
            assert padded <= 1.15 * width or b <= max(512, 16), (width, max_block, b)
    assert sw.row_block(5440, 4096) == 2048  # 3 blocks (88% used) rather than 2 (66%)


_SM90_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hydra_kernels.ops import swiglu as sw

def ptx(fn, sig, consts, divisible, warps):
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": 1}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

for fn, n_ptr in ((sw._swiglu_fwd_kernel, 3), (sw._swiglu_bwd_kernel, 5)):
    names = fn.arg_names
    sig = {n: "*bf16" for n in names[:n_ptr]} | {n: "i32" for n in names[n_ptr:-1]} | {"BLOCK": "constexpr"}
    code = ptx(fn, sig, {"BLOCK": 4096}, [n for n in names[:-1] if n != "col_blocks"], 8)
    # 4096 elements over 256 threads: 16 bf16 per thread and tensor = two 16-byte accesses
    loads, stores = (len(re.findall(op + r"\.global\S*\.v4", code)) for op in ("ld", "st"))
    print(fn.__name__, loads, stores)
"""


def test_kernels_compile_for_sm90_with_16_byte_accesses():
    """GPU code generation (no GPU needed: Triton compiles for an sm_90 target offline)."""
    counts = sm90_access_counts(_SM90_COMPILE)
    assert counts["_swiglu_fwd_kernel"] == (4, 2)  # 2 inputs x 2 loads, 1 output x 2 stores
    assert counts["_swiglu_bwd_kernel"] == (6, 4)
