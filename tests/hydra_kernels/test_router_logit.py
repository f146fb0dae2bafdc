"""router_logit: a router's logits on the RMS-normalised stream (Triton, interpreted on the CPU)
against an fp64 oracle (hydra_kernels.numerics' criterion, with the op-by-op reference in fp32
as the yardstick), on fresh random rows, strided and contiguous; the seed is in every failure
message."""

import math

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import router_logit as rl_mod
from hydra_kernels.ops.router_logit import router_logit, router_logit_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON
EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim", "strided"), [(1, 48, False), (37, 200, True), (64, 1100, False)])
def test_router_logit_equals_the_fp64_logit(seed, dtype, rows, dim, strided):
    wide = torch.randn(rows, dim + (24 if strided else 0)).to(dtype)
    h = wide[:, 8 : 8 + dim] if strided else wide  # rows of a wider buffer, as a [B, n, E] stream's
    w = (torch.randn(dim) / math.sqrt(dim) * 3).to(dtype)
    b = (0.2 * torch.randn(())).to(dtype)
    ref64 = (h.double() @ w.double()) / torch.sqrt(h.double().pow(2).mean(-1) + EPS) + b.double()
    falls = controls.fallback_counts().get("router_logit", 0)
    got = router_logit(h.to(DEVICE), w.to(DEVICE), b.to(DEVICE), EPS)
    assert controls.fallback_counts().get("router_logit", 0) == falls  # the kernel ran
    assert got.dtype == torch.float32 and got.shape == (rows,)
    same = router_logit_ref(h, w, b, EPS)
    result = check_against_fp64(got.cpu(), same, ref64, fp32_noise_atol(ref64))
    assert result, f"seed {seed}: {result.describe()}"


def test_switched_off_it_runs_the_reference_and_bad_shapes_raise():
    h, w = torch.randn(5, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    b = torch.zeros((), device=DEVICE)
    controls.set_op_enabled("router_logit", False)
    assert torch.equal(router_logit(h, w, b, EPS), router_logit_ref(h, w, b, EPS))
    with pytest.raises(ValueError, match="router_logit: h"):
        router_logit(h, torch.randn(15, device=DEVICE), b, EPS)


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"H": "*bf16", "W": "*bf16", "BIAS": "*bf16", "OUT": "*fp32", "stride_h": "i32", "eps": "fp32"}
    consts = {"N_ROWS": 64, "DIM": 768, "BLOCK_R": 16, "BLOCK_E": 1024}
    build_sm90(rl_mod._router_logit_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
