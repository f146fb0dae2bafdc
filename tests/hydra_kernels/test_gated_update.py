"""gated_update_: a routed block's gated residual update in place (Triton, interpreted on the CPU)
against the op-by-op form hydra_model wrote before (the same bits: the kernel rounds where the
eager ops round), and that form against fp64 arithmetic; fresh random rows, with and without an
index and a take mask, strided rows; the seed is in every failure message."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import gated_update as gu_mod
from hydra_kernels.ops.gated_update import gated_update_, gated_update_ref_

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _eager_scatter(h, out, weight, take, index):
    """hydra_model's former no-grad form: routing.SubSequence.scatter_add of the gated update."""
    b_rows = torch.arange(out.shape[0]) if index is None else index
    update = weight[b_rows].unsqueeze(-1) * (out - h[b_rows])
    if take is not None:
        update = torch.where(take.unsqueeze(-1), update, torch.zeros_like(update))
    return h.index_add(0, b_rows, update.to(h.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "m", "dim", "indexed", "masked", "strided"),
    [(1, 1, 48, False, True, False), (5, 5, 200, False, True, True), (40, 9, 1100, True, True, False),
     (33, 12, 96, True, False, True)],
)  # fmt: skip
def test_gated_update_gives_the_op_by_op_bits(seed, dtype, n, m, dim, indexed, masked, strided):
    wide = torch.randn(n, dim + (16 if strided else 0)).to(dtype)
    h = wide[:, 8 : 8 + dim] if strided else wide  # rows of a wider buffer
    out = torch.randn(m, dim).to(dtype)
    weight = torch.rand(n)  # σ(logit): fp32 in (0, 1)
    index = torch.randperm(n)[:m] if indexed else None
    take = torch.rand(m) < 0.6 if masked else None
    expected = _eager_scatter(h.clone(), out, weight, take, index)
    falls = controls.fallback_counts().get("gated_update", 0)
    wide_dev = wide.clone().to(DEVICE)  # a copy: on the CPU .to() would hand back h itself
    got = wide_dev[:, 8 : 8 + dim] if strided else wide_dev
    returned = gated_update_(
        got, out.to(DEVICE), weight.to(DEVICE), None if take is None else take.to(DEVICE),
        None if index is None else index.to(DEVICE),
    )  # fmt: skip
    assert returned is got and controls.fallback_counts().get("gated_update", 0) == falls  # the kernel ran
    assert torch.equal(got.cpu(), expected), f"seed {seed}: max diff {(got.cpu() - expected).abs().max()}"
    # the reference is the same form, and the form is the fp64 update rounded where it rounds
    ref = gated_update_ref_(h.clone(), out, weight, take, index)
    assert torch.equal(ref, expected), f"seed {seed}"
    rows = torch.arange(m) if index is None else index
    keep = torch.ones(m, dtype=torch.bool) if take is None else take
    hd, od = h.double(), out.double()
    want = hd.clone()
    want[rows[keep]] = hd[rows[keep]] + weight.double()[rows[keep]].unsqueeze(-1) * (od - hd[rows])[keep]
    tol = 4 * torch.finfo(dtype).eps * (want.abs() + hd.abs() + od.abs().max())
    assert ((got.cpu().double() - want).abs() <= tol).all(), f"seed {seed}"
    if indexed:  # an int32 index, after the int64 one of the same shapes (a launch plan each)
        again = wide.clone().to(DEVICE)
        again = again[:, 8 : 8 + dim] if strided else again
        gated_update_(again, out.to(DEVICE), weight.to(DEVICE), None if take is None else take.to(DEVICE),
                      index.int().to(DEVICE))  # fmt: skip
        assert torch.equal(again.cpu(), expected), f"seed {seed}: int32 index"
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[rows[keep]] = False
    assert torch.equal(got.cpu()[untouched], h[untouched]), f"seed {seed}: a row not taken changed"


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    h, out = torch.randn(6, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    w = torch.rand(6, device=DEVICE)
    take = torch.tensor([True, False, True, True], device=DEVICE)
    controls.set_op_enabled("gated_update", False)
    expected = gated_update_ref_(h.clone(), out, w, take)
    assert torch.equal(gated_update_(h.clone(), out, w, take), expected)
    with pytest.raises(ValueError, match="weight must be"):
        gated_update_(h, out, w.double())
    with pytest.raises(ValueError, match="take must be"):
        gated_update_(h, out, w, take[:3])
    with pytest.raises(ValueError, match="must not exceed"):
        gated_update_(h[:3], out, w[:3])
    with pytest.raises(ValueError, match="one dtype"):
        gated_update_(h, out.double(), w)


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"H": "*bf16", "OUT": "*bf16", "W": "*fp32", "TAKE": "*u8", "IDX": "*i64", "stride_h": "i32",
           "stride_o": "i32"}  # fmt: skip
    for has_take, has_index in ((True, True), (True, False), (False, False)):
        consts = {"DIM": 768, "BLOCK_E": 1024, "HAS_TAKE": has_take, "HAS_INDEX": has_index, "BF16": True}
        build_sm90(gu_mod._gated_update_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
