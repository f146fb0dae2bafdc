"""last_rows: each sequence's last real rows of a prefix-masked batch, copied out flat (Triton,
interpreted on the CPU), against a loop over the sequences written here (a copy: the same bits);
fresh random rows and lengths (0 and n included), strided sources, a strided output; the seed is in
every failure message."""

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.ops import last_rows as lr_mod
from hydra_kernels.ops.last_rows import last_rows, last_rows_ref

from .conftest import DEVICE, NEEDS_TRITON, assert_compiles_for_sm90, build_sm90

pytestmark = NEEDS_TRITON


def _by_loop(src: torch.Tensor, length: torch.Tensor, rows: int) -> torch.Tensor:
    b, _, c = src.shape
    out = torch.zeros(b, rows, c, dtype=src.dtype)
    for i in range(b):
        for s in range(rows):
            t = int(length[i]) - rows + s
            if t >= 0:
                out[i, s] = src[i, t]
    return out.reshape(b, rows * c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "n", "c", "rows", "strided"), [(1, 7, 48, 2, False), (5, 9, 200, 3, True),
                                                              (3, 4, 1100, 1, True), (4, 2, 16, 2, False)])
def test_last_rows_copies_each_sequences_last_real_rows(seed, dtype, b, n, c, rows, strided):
    wide = torch.randn(b, n, c + (24 if strided else 0)).to(dtype)
    src = wide[..., 8 : 8 + c] if strided else wide  # a slice of a wider projection, as ccgqa's
    length = torch.randint(0, n + 1, (b,))
    length[0] = n  # every row real
    if b > 1:
        length[1] = 0  # none: all zeros
    expected = _by_loop(src, length, rows)
    falls = controls.fallback_counts().get("last_rows", 0)
    got = last_rows(src.to(DEVICE), length.to(DEVICE), rows)
    assert controls.fallback_counts().get("last_rows", 0) == falls  # the kernel ran
    assert torch.equal(got.cpu(), expected), f"seed {seed}"
    assert torch.equal(last_rows_ref(src, length, rows), expected), f"seed {seed}"
    # into a strided output (the first columns of a wider row buffer), the rest untouched
    buf = torch.full((b, rows * c + 5), 7.0, dtype=dtype, device=DEVICE)
    last_rows(src.to(DEVICE), length.to(DEVICE), rows, out=buf[:, : rows * c])
    assert torch.equal(buf[:, : rows * c].cpu(), expected), f"seed {seed}"
    assert bool((buf[:, rows * c :] == 7).all()), f"seed {seed}: a column past the rows was written"


def test_switched_off_it_runs_the_reference_and_bad_inputs_raise():
    src, length = torch.randn(2, 5, 8, device=DEVICE), torch.tensor([3, 5], device=DEVICE)
    controls.set_op_enabled("last_rows", False)
    assert torch.equal(last_rows(src, length, 2), last_rows_ref(src, length, 2))
    with pytest.raises(ValueError, match="length \\[B\\] integers"):
        last_rows(src, length.float(), 2)
    with pytest.raises(ValueError, match="out must be"):
        last_rows(src, length, 2, out=torch.empty(2, 15, device=DEVICE))


def _compile_for_sm90() -> None:
    """Runs in a subprocess without TRITON_INTERPRET (see the test below)."""
    sig = {"SRC": "*bf16", "DST": "*bf16", "LEN": "*i64", "n": "i32", "stride_sb": "i32", "stride_st": "i32",
           "stride_db": "i32"}  # fmt: skip
    build_sm90(lr_mod._last_rows_kernel, sig, {"ROWS": 2, "C": 1024, "BLOCK": 1024}, 4, 1)


def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter skips Triton's compiler: compile for sm_90 so GPU-only errors show here."""
    assert_compiles_for_sm90(__file__)
