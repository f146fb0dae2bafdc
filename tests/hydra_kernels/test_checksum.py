"""checksum: a tensor's raw bits, each word weighted by its position, summed modulo 2**64 (Triton,
interpreted on the CPU) against the PyTorch reference and a Python big-integer computation, and
the changes it must see: one changed element, two swapped ones, a flipped dimension.

Inputs are fresh random each test; the seed is in every failure message.
"""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import checksum as cs_mod
from hydra_kernels.ops.checksum import checksum_ref, checksums, words

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def python_checksum(t: torch.Tensor) -> int:
    """The definition in Python integers: Σ w_i · (2i + 1) mod 2**64, words zero-extended."""
    w = words(t.cpu())
    bits = w.element_size() * 8
    total = sum((int(v) % (1 << bits)) * (2 * i + 1) for i, v in enumerate(w.tolist()))
    return total % (1 << 64)


def signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((37, 5), torch.bfloat16), ((9000,), torch.float32), ((3, 7), torch.float16), ((5,), torch.int64),
     ((11,), torch.bool), ((4099,), torch.bfloat16)],
)  # fmt: skip
def test_checksum_equals_its_definition(seed, shape, dtype):
    if dtype == torch.bool:
        t = torch.rand(shape) < 0.5
    elif dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, shape)
    else:
        t = (torch.randn(shape) * 100).to(dtype)
    falls = controls.fallback_counts().get("checksum", 0)
    got = checksums([t.to(DEVICE)])
    assert got.dtype == torch.int64 and got.shape == (1,)
    assert int(got[0]) == signed(python_checksum(t)), f"seed {seed}"
    assert int(checksum_ref(words(t))) == signed(python_checksum(t)), f"seed {seed}"
    assert controls.fallback_counts().get("checksum", 0) == falls  # the kernel ran


def test_it_sees_a_changed_element_a_swap_and_a_flip(seed):
    t = torch.randn(64, 48, dtype=torch.bfloat16, device=DEVICE)
    base = int(checksums([t])[0])
    for change in ("one", "swap", "flip"):
        u = t.clone()
        if change == "one":
            i = int(torch.randint(0, u.numel(), ()))
            u.view(torch.int16).view(-1)[i] ^= 1  # the lowest mantissa bit of one element
        elif change == "swap":
            u.view(-1)[[3, 1000]] = u.view(-1)[[1000, 3]]
        else:
            u = u.flip(0).contiguous()
        assert not torch.equal(u, t)
        assert int(checksums([u])[0]) != base, f"seed {seed}: {change} not seen"


def test_the_reference_in_chunks_equals_it_in_one(monkeypatch):
    t = torch.randint(-(2**31), 2**31, (1000,), dtype=torch.int32)
    whole = int(checksum_ref(t))
    monkeypatch.setattr(cs_mod, "REF_CHUNK", 77)
    assert int(checksum_ref(t)) == whole == signed(python_checksum(t))


def test_several_tensors_in_one_call_and_bad_inputs():
    a, b = torch.randn(10, device=DEVICE), torch.randn(3, 4, device=DEVICE).half()
    both = checksums([a, b])
    assert both.tolist() == [int(checksums([a])[0]), int(checksums([b])[0])]
    with pytest.raises(ValueError, match="contiguous"):
        checksums([torch.randn(4, 4, device=DEVICE).t()])
    with pytest.raises(ValueError, match="no tensors"):
        checksums([])


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    build_sm90(
        cs_mod._checksum_kernel, {"W": "*i32", "OUT": "*i64", "n": "i32"}, {"BLOCK": 4096, "BITS": 32}, 4, 1
    )


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
