"""rope: the Triton rotation kernel (interpreted on CPU) against an fp64 reference.

Every output and gradient must satisfy |kernel − fp64| ≤ 2·|torch same dtype − fp64| + atol
(hydra_kernels.numerics). Inputs are fresh random each run; the seed is in every failure message.
"""

import warnings

import pytest
import torch

from hydra_kernels import controls, rope
from hydra_kernels.launch_config import set_launch_overrides
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import rope as rp
from hydra_kernels.ops.rope import rope_ref

from .conftest import DEVICE, NEEDS_TRITON, sm90_access_counts

pytestmark = NEEDS_TRITON


def _tables(*shape, dtype=torch.float32):
    angles = 10 * torch.randn(*shape, device=DEVICE, dtype=torch.float64)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _check(x, cos, sin, seed):
    """rope (kernel) vs rope_ref in x's dtype vs rope_ref in fp64, output and dx."""
    dy = torch.randn(x.shape, device=DEVICE).to(x.dtype)
    k_out = rope(x, cos, sin)
    (k_dx,) = torch.autograd.grad(k_out, x, dy)
    t_out = rope_ref(x, cos, sin)
    (t_dx,) = torch.autograd.grad(t_out, x, dy)
    x64 = x.detach().double().requires_grad_()
    r_out = rope_ref(x64, cos.double(), sin.double())
    (r_dx,) = torch.autograd.grad(r_out, x64, dy.double())
    for name, k, t, r in (("out", k_out, t_out, r_out), ("dx", k_dx, t_dx, r_dx)):
        assert k.dtype == x.dtype and k.shape == x.shape, name
        res = check_against_fp64(k, t, r, atol=fp32_noise_atol(r))
        assert res.passed, f"{name} (seed={seed}): {res.describe()}"
    assert "Rope" in type(k_out.grad_fn).__name__, f"reference ran instead: {k_out.grad_fn}"
    assert controls.fallback_counts()["rope"] == 0
    return k_out


@pytest.mark.parametrize(
    ("b", "s", "h", "d", "r", "per_seq", "dtype"),
    [
        (2, 5, 3, 24, 16, False, torch.float32),
        (2, 7, 3, 40, 40, True, torch.bfloat16),
        (1, 9, 2, 20, 12, False, torch.bfloat16),
        (3, 4, 5, 64, 32, True, torch.float16),
    ],
)
def test_rope_matches_fp64(b, s, h, d, r, per_seq, dtype, seed):
    x = torch.randn(b, s, h, d, device=DEVICE).to(dtype).requires_grad_()
    cos, sin = _tables(*((b, s, r // 2) if per_seq else (s, r // 2)))
    _check(x, cos, sin, seed)


def test_strided_views_of_x(seed):
    heads, kv_heads, d = 4, 2, 24
    qkv = torch.randn(2, 6, (heads + 2 * kv_heads) * d, device=DEVICE, dtype=torch.bfloat16)
    k = qkv[..., heads * d : (heads + kv_heads) * d].view(2, 6, kv_heads, d).requires_grad_()
    assert not k.is_contiguous()
    cos, sin = _tables(6, 8)
    _check(k, cos, sin, seed)
    bhsd = torch.randn(2, heads, 6, d, device=DEVICE)
    x = bhsd.transpose(1, 2).requires_grad_()  # [B, S, H, D] view of a [B, H, S, D] tensor
    _check(x, cos, sin, seed)


def test_channels_from_r_are_copied_exactly_and_r0_is_identity(seed):
    x = torch.randn(2, 5, 3, 30, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = _tables(5, 7)
    out = rope(x, cos, sin)
    assert torch.equal(out[..., 14:], x[..., 14:])
    empty = torch.empty(5, 0, device=DEVICE)
    assert torch.equal(rope(x, empty, empty), x)


def test_per_sequence_tables_match_one_sequence_at_a_time(seed):
    x = torch.randn(3, 7, 2, 16, device=DEVICE)
    cos, sin = _tables(3, 7, 6)
    together = rope(x, cos, sin)
    for b in range(3):
        alone = rope(x[b : b + 1], cos[b], sin[b])
        torch.testing.assert_close(together[b : b + 1], alone, rtol=0, atol=0)


def test_several_rows_per_program_and_low_precision_tables(seed):
    set_launch_overrides("rope", block_rows=4, num_warps=2)  # 3·5·3 = 45 rows: ragged last block
    x = torch.randn(3, 5, 3, 20, device=DEVICE).to(torch.bfloat16).requires_grad_()
    cos, sin = _tables(5, 10, dtype=torch.bfloat16)
    _check(x, cos, sin, seed)


def test_tables_that_require_grad_take_the_differentiable_reference(seed):
    x = torch.randn(2, 5, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = (t.requires_grad_() for t in _tables(5, 8))
    out = rope(x, cos, sin)
    assert "Rope" not in type(out.grad_fn).__name__
    dcos, dsin = torch.autograd.grad(out.sum(), (cos, sin))
    assert dcos.abs().sum() > 0 and dsin.abs().sum() > 0


def test_compile_fullgraph_has_no_graph_breaks(seed):
    def f(x, cos, sin):
        return (rope(x, cos, sin) * 3).sum()

    x = torch.randn(2, 5, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 6)
    explained = torch._dynamo.explain(f)(x, cos, sin)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    (got,) = torch.autograd.grad(compiled(x, cos, sin), x)
    (want,) = torch.autograd.grad(f(x, cos, sin), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert controls.fallback_counts()["rope"] == 0


def test_switched_off_runs_the_reference(seed):
    controls.set_op_enabled("rope", False)
    x = torch.randn(2, 5, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 8)
    out = rope(x, cos, sin)
    assert "Rope" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, rope_ref(x, cos, sin), rtol=0, atol=0)


def test_backward_switch_off_rotates_back_in_pytorch(seed, monkeypatch):
    controls.set_op_enabled("rope", True, backward=False)
    calls = []
    real = rp._launch_rope
    monkeypatch.setattr(rp, "_launch_rope", lambda *a: calls.append(a[3]) or real(*a))
    x = torch.randn(2, 5, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 8)
    _check(x, cos, sin, seed)
    assert calls == [False]  # the forward kernel only; no inverse rotation launched


@pytest.mark.fallback_expected
def test_kernel_failure_falls_back_counted_and_warned_once(seed, monkeypatch):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(rp, "_launch_rope", broken)
    x = torch.randn(2, 5, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 8)
    dy = torch.randn(x.shape, device=DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rope(x, cos, sin)
        (dx,) = torch.autograd.grad(out, x, dy)
    torch.testing.assert_close(out, rope_ref(x, cos, sin), rtol=0, atol=0)
    (want,) = torch.autograd.grad(rope_ref(x, cos, sin), x, dy)
    torch.testing.assert_close(dx, want, rtol=1e-6, atol=1e-6)
    assert controls.fallback_counts()["rope"] == 2  # forward and backward both fell back
    failures = [w for w in caught if "simulated kernel failure" in str(w.message)]
    assert len(failures) == 1 and issubclass(failures[0].category, RuntimeWarning)


def test_bad_shapes_are_named():
    x = torch.randn(2, 5, 3, 16)
    cos, sin = _tables(5, 8)
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        rope(x[0], cos, sin)
    with pytest.raises(ValueError, match="exceeds the head dim"):
        rope(x, *_tables(5, 9))
    with pytest.raises(ValueError, match="S=5"):
        rope(x, *_tables(6, 8))
    with pytest.raises(ValueError, match="differ in shape"):
        rope(x, cos, sin[:, :4])


_SM90_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hydra_kernels.ops import rope as rp

fn = rp._rope_kernel
ptrs = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"}
ints = [n for n in fn.arg_names[4:] if n.islower()]
divisible = [*ptrs, "n_rows", "stride_xb", "stride_xs", "stride_xh", "stride_tb", "stride_ts"]
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
sig = ptrs | {n: "i32" for n in ints} | {n: "constexpr" for n in fn.arg_names if n.isupper()}
for half, rest, rows in ((16, 32, 32), (32, 0, 32), (64, 0, 16)):
    consts = {"SIGN": 1.0, "HALF": half, "REST": rest, "BLOCK_ROWS": rows, "BLOCK_HALF": half,
              "BLOCK_REST": max(rest, 1)}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": 4, "num_stages": 1}
    code = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    loads, stores = (len(re.findall(op + r"\.global\S*\.v4", code)) for op in ("ld", "st"))
    print(f"{2 * half + rest}/{2 * half}", loads, stores)
"""


def test_kernel_compiles_for_sm90_with_vector_accesses():
    """GPU code generation at the presets' head shapes (Triton compiles for sm_90 offline)."""
    counts = sm90_access_counts(_SM90_COMPILE)
    # D=R=64, 32 rows, 128 threads: x halves 8 bf16 per thread (one 16-byte load each), cos/sin
    # 8 fp32 (two each), both halves stored in one 16-byte store each
    assert counts["64/64"] == (6, 2)
    assert counts["128/128"][0] >= 6 and counts["128/128"][1] >= 2
    assert counts["64/32"][0] >= 3  # cos, sin and the copied half at least
