"""ccgqa_window_tiles: CCGQA's conv weights as a decode window's tiles, many modules in one kernel
(Triton, interpreted on the CPU), against an fp64 oracle written element by element from the
module docstring's formula (hydra_kernels.numerics' criterion, the reference in the parameters'
dtype as the yardstick), on fresh random parameters; the seed is in every failure message."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.ops import ccgqa_window_tiles as wt_mod
from hydra_kernels.ops.ccgqa_window_tiles import ccgqa_window_tiles, ccgqa_window_tiles_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _params(count, c, d, k_seq, k_ch, dtype):
    """Random parameters of ``count`` modules; the q-k mean dense and random (any [C, C] works)."""
    out = []
    for _ in range(count):
        seq_w, seq_b = torch.randn(c, 1, k_seq), 0.3 * torch.randn(c)
        ch_w, ch_b = torch.randn(c, d, k_ch) / d, 0.3 * torch.randn(c)
        out.append(tuple(t.to(dtype) for t in (seq_w, seq_b, ch_w, ch_b, 0.5 * torch.randn(c, c))))
    return out


def _oracle(params, index, block_n, block_k):
    """fp64, one element at a time from the formula (loops over heads, taps and tiles)."""
    seq_w, seq_b, ch_w, ch_b, mean = params
    c, d, k_ch = ch_w.shape
    k_seq = seq_w.shape[2]
    k_total = k_seq + k_ch - 1
    w = torch.zeros(c, k_total * c, dtype=torch.float64)
    for r in range(c):
        g = r // d
        for s in range(k_total):
            for i in range(d):
                w[r, s * c + g * d + i] = sum(
                    ch_w[r, i, a].double() * seq_w[g * d + i, 0, s - a].double()
                    for a in range(k_ch)
                    if 0 <= s - a < k_seq
                )
        w[r, (k_total - 1) * c :] += mean[r].double()
    bias = ch_b.double().clone()
    for r in range(c):
        g = r // d
        bias[r] += sum(ch_w[r, i].double().sum() * seq_b[g * d + i].double() for i in range(d))
    nb, nnz = index.shape
    tiles = torch.zeros(nb, nnz, block_n, block_k, dtype=torch.float64)
    for row in range(nb):
        for slot in range(nnz):
            col = int(index[row, slot])
            if col >= 0:
                part = w[row * block_n : (row + 1) * block_n, col * block_k : (col + 1) * block_k]
                tiles[row, slot, : part.shape[0], : part.shape[1]] = part
    return tiles, bias


def _index(nb, kb, nnz, gen):
    """[NB, NNZ] int32: distinct random block columns per row, a random number of them, −1 after."""
    index = torch.full((nb, nnz), -1, dtype=torch.int32)
    for row in range(nb):
        kept = int(torch.randint(1, nnz + 1, (), generator=gen))
        index[row, :kept] = torch.randperm(kb, generator=gen)[:kept].sort().values.to(torch.int32)
    return index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("count", "c", "d", "k_seq", "k_ch", "block"),
    [(3, 64, 16, 2, 2, 16), (2, 48, 16, 3, 2, 32), (1, 40, 8, 1, 3, 16)],  # edge tiles at C = 48, 40
)
def test_ccgqa_window_tiles_equals_the_fp64_formula(seed, dtype, count, c, d, k_seq, k_ch, block):
    gen = torch.Generator().manual_seed(seed)
    params = _params(count, c, d, k_seq, k_ch, dtype)
    k_total = k_seq + k_ch - 1
    nb, kb = -(-c // block), -(-(k_total * c) // block)
    index = _index(nb, kb, min(kb, 5), gen)
    falls = controls.fallback_counts().get("ccgqa_window_tiles", 0)
    on_device = [tuple(t.to(DEVICE) for t in p) for p in params]
    tiles, bias = ccgqa_window_tiles(on_device, index.to(DEVICE), block, block)
    assert controls.fallback_counts().get("ccgqa_window_tiles", 0) == falls  # the kernel ran
    assert tiles.dtype == bias.dtype == dtype
    assert tiles.shape == (count, nb, index.shape[1], block, block) and bias.shape == (count, c)
    same_tiles, same_bias = ccgqa_window_tiles_ref(params, index, block, block)
    for m in range(count):
        ref_tiles, ref_bias = _oracle(params[m], index, block, block)
        for got, same, ref in ((tiles[m], same_tiles[m], ref_tiles), (bias[m], same_bias[m], ref_bias)):
            result = check_against_fp64(got.cpu(), same, ref, fp32_noise_atol(ref))
            assert result, f"seed {seed}, module {m}: {result.describe()}"
    padding = (index < 0).to(DEVICE)
    assert not tiles[:, padding].any(), f"seed {seed}: padding tiles are not zeros"


def test_modules_are_read_where_they_are_and_new_values_are_seen(seed):
    """Parameters at their own addresses (no stacked copy): a second call after an in-place change
    sees the new values, one module at a time, with the address table kept."""
    params = [tuple(t.to(DEVICE) for t in p) for p in _params(2, 32, 16, 2, 2, torch.float32)]
    index = torch.arange(6, dtype=torch.int32).repeat(2, 1).to(DEVICE)  # every tile of [32, 96] at 16
    first, _ = ccgqa_window_tiles(params, index, 16, 16)
    params[1][2].mul_(2.0)  # module 1's grouped-conv taps
    second, _ = ccgqa_window_tiles(params, index, 16, 16)
    assert torch.equal(first[0], second[0]), f"seed {seed}"
    expect, _ = ccgqa_window_tiles_ref(params, index, 16, 16)
    assert torch.allclose(second[1], expect[1], rtol=1e-5, atol=1e-6), f"seed {seed}"
    assert not torch.allclose(first[1], second[1]), f"seed {seed}"


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    params = [tuple(t.to(DEVICE) for t in p) for p in _params(2, 32, 16, 2, 2, torch.float32)]
    index = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    controls.set_op_enabled("ccgqa_window_tiles", False)
    got = ccgqa_window_tiles(params, index, 16, 16)
    want = ccgqa_window_tiles_ref(params, index, 16, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="module 1's parameters"):
        ccgqa_window_tiles([params[0], (*params[1][:4], params[1][4][:8])], index, 16, 16)
    with pytest.raises(ValueError, match="power of two"):
        ccgqa_window_tiles(params, index, 16, 24)
    with pytest.raises(ValueError, match="no modules"):
        ccgqa_window_tiles([], index)
    # an index no path can use is the caller's mistake on every path, not a kernel fallback
    for on in (False, True):
        controls.set_op_enabled("ccgqa_window_tiles", on)
        with pytest.raises(ValueError, match="int32"):
            ccgqa_window_tiles(params, index.long(), 16, 16)
        with pytest.raises(ValueError, match="block rows"):
            ccgqa_window_tiles(params, index[:1], 16, 16)


def _every_other(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at every other element of a buffer twice as large: not contiguous."""
    return torch.stack([t, torch.full_like(t, float("nan"))], -1)[..., 0]


def test_non_contiguous_parameters_run_the_kernel(seed):
    """Non-contiguous parameters (a module's need not be contiguous after a load with assign=True,
    hydra_model/persistence.py) are copied and the kernel runs: the launcher refused them, a
    counted fallback to the reference. Module 1's five parameters all strided (the q-k mean
    transposed), module 0's not; the tiles are the contiguous call's, bitwise: tiles of a
    head's conv taps and of the q-k mean in each block row, and the bias."""
    params = [tuple(t.to(DEVICE) for t in p) for p in _params(2, 32, 16, 2, 2, torch.bfloat16)]
    # [32, 96] at 16: block row 0 is head 0 (columns 0: its taps at s = 0; 5: the mean at s = 2),
    # block row 1 head 1 (3: its taps at s = 1; 4: the mean)
    index = torch.tensor([[0, 5], [3, 4]], dtype=torch.int32, device=DEVICE)
    want = ccgqa_window_tiles(params, index, 16, 16)
    *convs, mean = params[1]
    params[1] = (*(_every_other(t) for t in convs), mean.t().contiguous().t())
    assert not any(t.is_contiguous() for t in params[1])
    got = ccgqa_window_tiles(params, index, 16, 16)
    assert controls.fallback_counts().get("ccgqa_window_tiles", 0) == 0, f"seed {seed}: the reference ran"
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"seed {seed}"


def test_a_parameter_on_another_device_is_named():
    """Every module's parameters on the first one's device, else a ValueError naming the one that
    is not (the launcher refused it, a counted fallback, and the reference failed in torch.stack
    naming nothing). The meta device stands in for another GPU."""
    params = [tuple(t.to(DEVICE) for t in p) for p in _params(2, 32, 16, 2, 2, torch.float32)]
    index = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    params[1] = (*params[1][:3], params[1][3].to("meta"), params[1][4])
    for on in (True, False):
        controls.set_op_enabled("ccgqa_window_tiles", on)
        with pytest.raises(ValueError, match=rf"ccgqa_window_tiles: module 1's ch_b .* is on meta but module "
                                             rf"0's seq_w is on {DEVICE.type}"):  # fmt: skip
            ccgqa_window_tiles(params, index, 16, 16)


def test_parameters_of_mixed_dtypes_take_the_reference(seed):
    """The kernel reads one dtype: parameters of several (a module's biases kept in fp32 beside
    bf16 weights) take the reference, as fp64 does, rather than a counted fallback from the
    launcher; the result is the reference's, in the first parameter's dtype."""
    params = [tuple(t.to(DEVICE) for t in p) for p in _params(2, 32, 16, 2, 2, torch.bfloat16)]
    params[1] = (*params[1][:3], params[1][3].float(), params[1][4])
    index = torch.arange(6, dtype=torch.int32).repeat(2, 1).to(DEVICE)
    got = ccgqa_window_tiles(params, index, 16, 16)
    assert controls.fallback_counts().get("ccgqa_window_tiles", 0) == 0, f"seed {seed}: a counted fallback"
    want = ccgqa_window_tiles_ref(params, index, 16, 16)
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"seed {seed}"


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"TABLE": "*i64", "INDEX": "*i32", "TILES": "*bf16", "BIAS": "*bf16", "n_modules": "i32"}
    consts = {"C": 1024, "D": 64, "K_SEQ": 2, "K_CH": 2, "NNZ": 6, "N_TILES": 96,
              "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_D": 64}  # fmt: skip
    build_sm90(wt_mod._window_tiles_kernel, sig, consts, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
