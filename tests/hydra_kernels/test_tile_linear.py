"""tile_linear: ``x·Wᵀ + bias`` from a weight's packed non-zero tiles (Triton, interpreted on the
CPU) against fp64 ``F.linear`` on the dense weight, and the packing itself.

Weights are fresh random each test with a random pattern of zero tiles (whole rows of tiles, a
block-diagonal like CCGQA's window convs, odd edges); the seed is in every failure message.
"""

import pytest
import torch
import torch.nn.functional as F

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import tile_linear as tl_mod
from hydra_kernels.ops.tile_linear import (
    TiledWeight,
    pack_tiles,
    pack_tiles_many,
    tile_linear,
    tile_linear_ref,
)

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def sparse_weight(n: int, k: int, bn: int, bk: int, density: float, dtype) -> torch.Tensor:
    """[n, k] with each bn×bk tile kept with probability ``density`` (some block rows all zero)."""
    w = torch.randn(n, k, dtype=torch.float64)
    keep = torch.rand(-(-n // bn), -(-k // bk)) < density
    keep[0] = False  # a block row with no tile at all
    mask = keep.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w * mask).to(dtype)


def block_diagonal(heads: int, d: int, taps: int, dtype) -> torch.Tensor:
    """CCGQA's window-conv pattern: head h's d outputs read its d channels at each of ``taps``
    window positions ([heads·d, taps·heads·d], columns position-major)."""
    c = heads * d
    w = torch.zeros(c, taps, c, dtype=torch.float64)
    for h in range(heads):
        w[h * d : (h + 1) * d, :, h * d : (h + 1) * d] = torch.randn(d, taps, d, dtype=torch.float64)
    return w.reshape(c, taps * c).to(dtype)


def check(x: torch.Tensor, dense: torch.Tensor, bias, packed, seed) -> None:
    got = tile_linear(x, packed, bias)
    ref64 = F.linear(x.double(), dense.double(), None if bias is None else bias.double())
    same = F.linear(x, dense, bias)  # torch in the input dtype: the criterion's yardstick
    assert got.dtype == x.dtype and got.shape == ref64.shape
    result = check_against_fp64(got.cpu(), same.cpu(), ref64.cpu(), fp32_noise_atol(ref64))
    assert result, f"seed {seed}: {result.describe()}"


SHAPES = [(96, 200, 32, 64, 1), (130, 77, 16, 32, 3), (64, 64, 64, 64, 2)]  # N, K, tile, rows of x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bn", "bk", "rows"), SHAPES)
def test_tile_linear_equals_the_dense_product(seed, dtype, n, k, bn, bk, rows):
    dense = sparse_weight(n, k, bn, bk, 0.4, dtype)
    packed = pack_tiles(dense.to(DEVICE), bn, bk)
    x = torch.randn(rows, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    falls = controls.fallback_counts().get("tile_linear", 0)
    check(x.to(DEVICE), dense.to(DEVICE), bias.to(DEVICE), packed, seed)
    check(x.to(DEVICE), dense.to(DEVICE), None, packed, seed)
    assert controls.fallback_counts().get("tile_linear", 0) == falls  # the kernel ran, no fallback


def test_the_ccgqa_window_pattern_packs_to_its_non_zero_tiles_and_multiplies(seed):
    """Block-diagonal per head over three window positions, 64-wide tiles: each block row keeps
    exactly one tile per position, a strided x (a view of a wider row), bf16."""
    heads, d, taps = 4, 16, 3
    dense = block_diagonal(heads, d, taps, torch.bfloat16).to(DEVICE)
    packed = pack_tiles(dense, 32, 32)
    assert packed.tiles.shape == (2, taps, 32, 32)  # 64 rows / 32; one non-zero tile per position
    assert (packed.index >= 0).all()
    row = torch.randn(2, taps * heads * d + 40, dtype=torch.bfloat16, device=DEVICE)
    x = row[:, : taps * heads * d]  # rows strided by the wider buffer
    check(x, dense, torch.randn(heads * d, dtype=torch.bfloat16, device=DEVICE), packed, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequences_sliding_windows_are_read_in_place(seed, dtype):
    """A prefill's conv windows: x [G, n, K·C] whose row t is window[g, t : t + K] flattened, a
    view with overlapping rows (row stride C) and groups strided by the sequence; the product
    equals fp64 F.linear on the windows copied out, with no copy made for the kernel."""
    heads, d, taps, n = 4, 16, 3, 5
    c = heads * d
    dense = block_diagonal(heads, d, taps, dtype).to(DEVICE)
    packed = pack_tiles(dense, 32, 32)
    seq = torch.randn(3, n + taps - 1 + 2, c, dtype=dtype, device=DEVICE)[:, 1 : n + taps]  # a view
    x = seq.unfold(1, taps, 1).transpose(2, 3).flatten(2)  # [G, n, K·C]
    assert x.stride() == (seq.stride(0), c, 1) and x.data_ptr() == seq.data_ptr()  # in place
    bias = torch.randn(c, dtype=dtype, device=DEVICE)
    falls = controls.fallback_counts().get("tile_linear", 0)
    got = tile_linear(x, packed, bias)
    assert got.shape == (3, n, c)
    flat = x.reshape(-1, taps * c)  # the windows copied out: the reference's input
    ref64 = F.linear(flat.double(), dense.double(), bias.double())
    same = F.linear(flat, dense, bias)
    result = check_against_fp64(got.reshape(-1, c).cpu(), same.cpu(), ref64.cpu(), fp32_noise_atol(ref64))
    assert result, f"seed {seed}: {result.describe()}"
    assert controls.fallback_counts().get("tile_linear", 0) == falls  # the kernel ran
    # the windows copied out and multiplied as rows: the same sums, bit for bit
    assert torch.equal(tile_linear(flat, packed, bias).view(3, n, c), got)
    torch.testing.assert_close(tile_linear_ref(x, packed, bias), got)  # the reference takes [G, B, K] too


def test_packing_keeps_exactly_the_non_zero_tiles(seed):
    dense = sparse_weight(70, 90, 16, 32, 0.3, torch.float32)
    packed = pack_tiles(dense, 16, 32)
    nb, nnz = packed.index.shape
    assert nb == 5 and packed.out_features == 70 and packed.in_features == 90
    rebuilt = torch.zeros(nb * 16, 3 * 32)
    for i in range(nb):
        cols = [int(c) for c in packed.index[i] if c >= 0]
        assert cols == sorted(cols)
        for j, c in enumerate(cols):
            rebuilt[i * 16 : (i + 1) * 16, c * 32 : (c + 1) * 32] = packed.tiles[i, j]
        assert not packed.tiles[i, len(cols) :].any()  # padding tiles are zeros
    assert torch.equal(rebuilt[:70, :90], dense), f"seed {seed}"
    assert nnz == max(1, max(int((packed.index[i] >= 0).sum()) for i in range(nb)))


def test_packing_many_shares_the_union_of_their_tiles_and_each_multiplies_as_alone(seed):
    """Three weights of different zero patterns packed together: one index (the tiles non-zero in
    any), each weight's tiles its own (zeros where it has none), and each product bitwise the
    product from its own packing (the kernel adds exact zeros for the extra tiles)."""
    dense = torch.stack([sparse_weight(48, 80, 16, 16, 0.4, torch.bfloat16) for _ in range(3)]).to(DEVICE)
    many = pack_tiles_many(dense, 16, 16)
    alone = [pack_tiles(w, 16, 16) for w in dense]
    union = torch.zeros(3, 5, dtype=torch.bool)
    for one in alone:
        for i in range(3):
            union[i, [int(c) for c in one.index[i] if c >= 0]] = True
    x = torch.randn(2, 80, dtype=torch.bfloat16, device=DEVICE)
    for packed, own, w in zip(many, alone, dense, strict=True):
        assert packed.index is many[0].index  # one shared index
        for i in range(3):
            cols = [int(c) for c in packed.index[i] if c >= 0]
            assert cols == sorted(cols) and cols == union[i].nonzero().flatten().tolist(), f"seed {seed}"
        assert torch.equal(tile_linear(x, packed), tile_linear(x, own)), f"seed {seed}"
        check(x, w, None, packed, seed)
    with pytest.raises(ValueError, match=r"must be \[L, N, K\]"):
        pack_tiles_many(dense[0], 16, 16)


def test_the_reference_alone_equals_the_dense_product(seed):
    dense = sparse_weight(50, 40, 8, 16, 0.5, torch.float64)
    packed = pack_tiles(dense, 8, 16)
    x, bias = torch.randn(3, 40, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(tile_linear_ref(x, packed, bias), F.linear(x, dense, bias), msg=f"seed {seed}")


def test_switched_off_it_runs_the_reference_and_bad_shapes_raise():
    dense = sparse_weight(32, 32, 16, 16, 0.5, torch.float32)
    packed = pack_tiles(dense.to(DEVICE), 16, 16)
    x = torch.randn(2, 32, device=DEVICE)
    controls.set_op_enabled("tile_linear", False)
    torch.testing.assert_close(tile_linear(x, packed), F.linear(x, dense.to(DEVICE)))
    with pytest.raises(ValueError, match=r"x must be \[B, 32\] or \[G, B, 32\]"):
        tile_linear(torch.randn(2, 31, device=DEVICE), packed)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        tile_linear(x, packed, torch.zeros(3, device=DEVICE))


@pytest.mark.parametrize("switch", ["kernel on", "kernel off"])
def test_a_bad_index_or_tiles_raise_on_every_path(switch):
    """A weight whose index or tiles no path can use is the caller's error, raised by name, not
    a kernel failure counted as a fallback (whichever path the switch picks)."""
    dense = sparse_weight(32, 32, 16, 16, 0.5, torch.float32)
    packed = pack_tiles(dense.to(DEVICE), 16, 16)
    x = torch.randn(2, 32, device=DEVICE)
    controls.set_op_enabled("tile_linear", switch == "kernel on")
    falls = controls.fallback_counts().get("tile_linear", 0)
    bad = {
        "int64": TiledWeight(packed.tiles, packed.index.long(), 32, 32),
        "shape": TiledWeight(packed.tiles, packed.index[:1].contiguous(), 32, 32),  # a block row short
        "device": TiledWeight(packed.tiles, packed.index.to("meta"), 32, 32),
    }
    for name, weight in bad.items():
        with pytest.raises(ValueError, match="the weight's index must be"):
            tile_linear(x, weight)
            pytest.fail(f"a bad index ({name}) ran")
    with pytest.raises(ValueError, match=r"the weight's tiles must be .* on x's device"):
        tile_linear(x, TiledWeight(packed.tiles.to("meta"), packed.index.to("meta"), 32, 32))
    assert controls.fallback_counts().get("tile_linear", 0) == falls


def test_non_contiguous_tiles_run_the_kernel(seed):
    """Tiles or index that are views out of order are copied for the kernel, not a fallback."""
    dense = sparse_weight(32, 48, 16, 16, 0.6, torch.float32).to(DEVICE)
    packed = pack_tiles(dense, 16, 16)
    swapped = packed.tiles.transpose(2, 3).contiguous().transpose(2, 3)  # same values, strided
    index = torch.stack([packed.index, packed.index], -1)[..., 0]  # same values, strided
    assert not swapped.is_contiguous() and not index.is_contiguous()
    falls = controls.fallback_counts().get("tile_linear", 0)
    x = torch.randn(3, 48, device=DEVICE)
    got = tile_linear(x, TiledWeight(swapped, index, 32, 48))
    assert torch.equal(got, tile_linear(x, packed))
    assert controls.fallback_counts().get("tile_linear", 0) == falls


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"X": "*bf16", "TILES": "*bf16", "INDEX": "*i32", "BIAS": "*bf16", "Y": "*bf16", "stride_xg": "i32",
           "stride_xb": "i32", "rows_per_group": "i32", "stride_yb": "i32"}  # fmt: skip
    consts = {"IN_FEATURES": 3072, "OUT_FEATURES": 1024, "NNZ": 6, "BLOCK_N": 64, "BLOCK_K": 64,
              "HAS_BIAS": True}  # fmt: skip
    build_sm90(tl_mod._tile_linear_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)


def test_tile_sizes_must_be_powers_of_two_and_a_strided_x_is_accepted(seed):
    dense = sparse_weight(32, 48, 16, 16, 0.6, torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        pack_tiles(dense, 24, 16)
    packed = pack_tiles(dense, 16, 16)
    x = torch.randn(48, 3, device=DEVICE).t()  # columns strided: copied for the kernel
    falls = controls.fallback_counts().get("tile_linear", 0)
    check(x, dense, None, packed, seed)
    assert controls.fallback_counts().get("tile_linear", 0) == falls
