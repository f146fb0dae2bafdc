"""total_norm: the L2 norm of many tensors together (Triton, interpreted on the CPU) against an
fp64 computation, across launch groups, program blocks, dtypes and empty tensors; fp32 from
either path; what takes the reference; a counted fallback; a table built during a capture refused.

Inputs are fresh random each test (the ``seed`` fixture); the seed is in every failure message.
"""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import total_norm as tn
from hydra_kernels.ops.total_norm import kernel_takes, total_norm, total_norm_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def fp64_norm(tensors) -> float:
    return float(sum(t.double().pow(2).sum() for t in tensors).sqrt())


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 elements and groups of 3 tensors: several programs a tensor and several
    launches at test sizes (the interpreter's cost is per program)."""
    monkeypatch.setattr(tn, "BLOCK", 64)
    monkeypatch.setattr(tn, "GROUP", 3)
    monkeypatch.setattr(tn, "_PLANS", {})
    monkeypatch.setattr(tn, "MAX_PLANS", 4)


def test_equals_fp64_across_groups_blocks_and_dtypes(seed, small_blocks):
    sizes = [1, 64, 65, 200, 0, 7, 129, 3, 64 * 5 + 1]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32,
              torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]  # fmt: skip
    ts = [(torch.randn(n) * 10 ** float(torch.empty(()).uniform_(-2, 2))).to(dt).to(DEVICE)
          for n, dt in zip(sizes, dtypes, strict=True)]  # fmt: skip
    assert kernel_takes(ts)
    falls = controls.fallback_counts().get("total_norm", 0)
    got = total_norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    want = fp64_norm(ts)
    # squares and sums in fp32: a few ulps of the sum
    assert abs(float(got) - want) <= 4e-6 * want, f"seed {seed}: {float(got)} vs {want}"
    assert controls.fallback_counts().get("total_norm", 0) == falls  # the kernel ran
    plan = next(iter(tn._PLANS.values()))
    assert len(plan.groups) >= 4  # four dtype groups of at most 3 tensors
    # a second call reuses the plan and gives the same bits
    assert torch.equal(total_norm(ts), got) and len(tn._PLANS) == 1
    # ever-new lists do not grow the plans past MAX_PLANS
    for n in range(2, tn.MAX_PLANS + 5):
        total_norm([ts[0], torch.ones(n, device=DEVICE)])
    assert len(tn._PLANS) <= tn.MAX_PLANS
    assert float(total_norm([torch.ones(9, device=DEVICE)])) == 3.0


def test_a_model_s_gradients_in_one_group(seed):
    """The shipped launch: 2-D and 1-D fp32 gradients of a small model, one launch."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 9)).to(DEVICE)
    model(torch.randn(5, 24, device=DEVICE)).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    got = total_norm(grads)
    want = fp64_norm(grads)
    assert abs(float(got) - want) <= 4e-6 * want, f"seed {seed}"
    torch.testing.assert_close(got, total_norm_ref(grads), rtol=4e-6, atol=0)


def test_what_takes_the_reference():
    a = torch.randn(6, 5, device=DEVICE)
    for ts in ([], [a.t()], [a.double()], [a, a.to(torch.int32)]):
        assert not kernel_takes(ts)
    assert float(total_norm([])) == 0.0
    torch.testing.assert_close(total_norm([a.t()]), torch.linalg.vector_norm(a))
    torch.testing.assert_close(total_norm([a.double()]), torch.linalg.vector_norm(a.double()))
    controls.set_op_enabled("total_norm", False)
    try:
        assert not kernel_takes([a])
    finally:
        controls.set_op_enabled("total_norm", True)
    assert kernel_takes([a, torch.nn.Parameter(a.clone())])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_norms_are_fp32_on_every_path(seed, dtype):
    """bf16/fp16 tensors' norm is fp32 from the kernel and from the reference alike (it was the
    inputs' dtype from the reference): the step's norm keeps its dtype whichever path ran."""
    ts = [torch.randn(n, device=DEVICE).to(dtype) for n in (100, 3)]
    assert kernel_takes(ts)
    got = {"kernel": total_norm(ts), "reference": total_norm_ref(ts)}
    controls.set_op_enabled("total_norm", False)
    try:
        got["switched off"] = total_norm(ts)
    finally:
        controls.set_op_enabled("total_norm", True)
    assert controls.fallback_counts().get("total_norm", 0) == 0
    want = fp64_norm(ts)
    for path, norm in got.items():
        assert norm.dtype == torch.float32 and norm.dim() == 0, path
        # the reference takes each tensor's norm in its dtype: within a few of its ulps
        assert abs(float(norm) - want) <= 8 * torch.finfo(dtype).eps * want, f"seed {seed}: {path}"


@pytest.mark.fallback_expected
def test_a_kernel_failure_is_counted_and_answered_by_the_reference(monkeypatch):
    a = torch.randn(100, device=DEVICE)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(tn, "_plan", broken)
    falls = controls.fallback_counts().get("total_norm", 0)
    with pytest.warns(RuntimeWarning):
        got = total_norm([a])
    assert controls.fallback_counts()["total_norm"] == falls + 1
    torch.testing.assert_close(got, torch.linalg.vector_norm(a))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_and_replayed_on_a_gpu(seed):
    ts = [torch.randn(n, device="cuda") for n in (3, 70000, 8192)]
    total_norm(ts)  # the table, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = total_norm(ts)
    for t in ts:
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert abs(float(out) - fp64_norm(ts)) <= 4e-6 * fp64_norm(ts), f"seed {seed}"
    fresh = [torch.randn(5, device="cuda")]
    with pytest.raises(RuntimeError, match="capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        tn._plan(fresh)


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    build_sm90(
        tn._sq_sums_kernel,
        {"PTRS": ("*fp32",) * 4, "TABLE": "*i64", "OUT": "*fp32", "out_start": "i32"},
        {"G": 4, "BLOCK": tn.BLOCK},
        tn.NUM_WARPS,
        1,
    )


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
