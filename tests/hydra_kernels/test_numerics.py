"""The acceptance criterion itself: it must fail what it is meant to fail."""

import os

import pytest
import torch

from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol


@pytest.fixture
def ref_and_torch():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = torch.randn(200, dtype=torch.float64)
    torch_err = 1e-3 * torch.randn(200, dtype=torch.float64)
    return ref, torch_err


def test_passes_up_to_twice_torch_error_elementwise(ref_and_torch):
    ref, e = ref_and_torch
    assert check_against_fp64(ref + 1.9 * e, ref + e, ref, atol=1e-12).passed
    res = check_against_fp64(ref + 2.2 * e, ref + e, ref, atol=1e-12)
    assert not res.passed and 1.05 < res.worst_ratio < 1.15


def test_one_bad_element_fails_elementwise_but_not_on_max(ref_and_torch):
    ref, e = ref_and_torch
    kernel = ref + e
    i = int(e.abs().argmin())
    # where torch is nearly exact, the kernel errs as much as torch's worst
    kernel[i] = ref[i] + e.abs().max()
    assert not check_against_fp64(kernel, ref + e, ref, atol=1e-9).passed
    assert check_against_fp64(kernel, ref + e, ref, atol=1e-9, reduction="max").passed


def test_non_finite_kernel_output_fails(ref_and_torch):
    ref, e = ref_and_torch
    for bad in (float("nan"), float("inf")):
        kernel = (ref + e).clone()
        kernel[3] = bad
        assert not check_against_fp64(kernel, ref + e, ref, atol=1.0).passed


def test_atol_covers_exact_torch():
    ref = torch.linspace(-4, 4, 101, dtype=torch.float64)
    noisy = ref * (1 + 4 * torch.finfo(torch.float32).eps)
    atol = fp32_noise_atol(ref)
    assert atol == pytest.approx(16 * torch.finfo(torch.float32).eps * 4)
    assert check_against_fp64(noisy, ref, ref, atol=atol).passed
    assert not check_against_fp64(ref + 1e-3, ref, ref, atol=atol).passed  # a bf16-sized error


def test_bad_arguments_raise():
    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="atol"):
        check_against_fp64(x, x, x, atol=0.0)
    with pytest.raises(ValueError, match="shape"):
        check_against_fp64(x[:2], x, x, atol=1.0)
    with pytest.raises(ValueError, match="reduction"):
        check_against_fp64(x, x, x, atol=1.0, reduction="mean")
