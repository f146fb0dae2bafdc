"""FP8 quantisation and the FP8 linear against fp64, with the CUDA GEMM emulated on the CPU.

The scaled matmul itself (``torch._scaled_mm``) needs an sm_89+ GPU: on the CPU the optimization is
N/A and its forward runs the emulation (dequantised operands multiplied in fp32), which these tests
check; ``packages/hydra-diag/bench/safe_opts_gpu_checks.py`` checks the GPU GEMM against the same
emulation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hydra_model import create_ccgqa_mod_mor_model
from hydra_train.safe_opts.fp8 import (
    FP8_FORMATS,
    Fp8Linear,
    _Fp8LinearFn,
    dequantize,
    fp8_eligible,
    quantize,
    revert_fp8,
    scaled_matmul,
    swap_to_fp8,
)

# half the spacing of the subnormals (E4M3: 2^-9, E5M2: 2^-16), the absolute floor of rounding
HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def quant_error_bound(x64: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    u = FP8_FORMATS[fmt][2]
    # fp8 rounding of x/scale (relative u, absolute floor in the subnormals), plus the fp32 divide
    # and multiply around it
    return u * x64.abs() + HALF_SUBNORMAL[fmt] * scale.double() + 2.0**-22 * x64.abs()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise", [True, False])
def test_quantize_error_against_fp64(fmt, rowwise):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 53, generator=g) * torch.logspace(-3, 2, 37).unsqueeze(
        1
    )  # rows of very different scale
    x[5] = 0.0  # an all-zero row must stay zero, not divide by zero
    q, s = quantize(x, fmt, rowwise)
    assert q.dtype == FP8_FORMATS[fmt][0] and s.shape == ((37, 1) if rowwise else ())
    back = dequantize(q, s).double()
    err = (back - x.double()).abs()
    assert torch.all(err <= quant_error_bound(x.double(), s.expand_as(x), fmt))
    assert torch.all(back[5] == 0)
    fmax = FP8_FORMATS[fmt][1]
    top = q.float().abs().amax(dim=-1) if rowwise else q.float().abs().amax()
    assert torch.all((top == fmax) | (top == 0))  # the largest magnitude lands on the largest finite value


@pytest.mark.parametrize("rowwise", [True, False])
def test_emulated_scaled_matmul_and_its_bound(rowwise):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(29, 48, generator=g)
    w = torch.randn(80, 48, generator=g) * 0.05
    xq, sx = quantize(x, "e4m3", rowwise)
    wq, sw = quantize(w, "e4m3", rowwise)
    out = scaled_matmul(xq, sx, wq, sw, torch.float32).double()
    xd, wd = dequantize(xq, sx).double(), dequantize(wq, sw).double()
    assert torch.allclose(out, xd @ wd.t(), rtol=1e-5, atol=1e-6)  # the emulation is the exact product
    dx = quant_error_bound(x.double(), sx.expand_as(x), "e4m3")
    dw = quant_error_bound(w.double(), sw.expand_as(w), "e4m3")
    bound = dx @ w.double().abs().t() + xd.abs() @ dw.t()  # |Σ x w − Σ x̂ ŵ| ≤ Σ |δx||w| + |x̂||δw|
    assert torch.all((out - x.double() @ w.double().t()).abs() <= bound + 1e-6)


def test_backward_is_the_bf16_straight_through_gradient():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 64, generator=g, dtype=torch.float64)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64) * 0.1
    gy = torch.randn(33, 48, generator=g, dtype=torch.float64)
    xb = x.to(torch.bfloat16).requires_grad_()
    wp = w.float().requires_grad_()
    _Fp8LinearFn.apply(xb, wp, "e4m3", True).backward(gy.to(torch.bfloat16))
    # reference: the gradient of x·wᵀ at the bf16-rounded operands, in fp64; bound: one bf16
    # rounding of each operand (relative 2^-8 each) and of the output
    xr, wr, gr = xb.detach().double(), w.to(torch.bfloat16).double(), gy.to(torch.bfloat16).double()
    for got, ref, mag in (
        (xb.grad.double(), gr @ wr, gr.abs() @ wr.abs()),
        (wp.grad.double(), gr.t() @ xr, gr.t().abs() @ xr.abs()),
    ):
        assert torch.all((got - ref).abs() <= 3 * 2.0**-8 * mag + 1e-6)


def tiny_model():
    torch.manual_seed(0)
    return create_ccgqa_mod_mor_model("tiny", dim=64, max_seq_len=64, vocab_size=320)


def test_swap_and_revert_keep_parameters_and_state_dict_keys():
    m = tiny_model()
    keys = list(m.state_dict())
    params = {n: p for n, p in m.named_parameters()}
    eligible = {n for n, mod in m.named_modules() if fp8_eligible(mod)}
    routers = {n for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and n.endswith("router")}
    assert eligible and routers and not (eligible & routers)  # 1- or R-wide routers stay bf16
    names = swap_to_fp8(m, "e5m2", rowwise=False)
    assert set(names) == eligible
    assert all(
        type(mod) is Fp8Linear and mod.fp8_format == "e5m2" for n, mod in m.named_modules() if n in eligible
    )
    assert list(m.state_dict()) == keys and all(p is params[n] for n, p in m.named_parameters())
    assert revert_fp8(m) == len(eligible)
    assert not any(isinstance(mod, Fp8Linear) for mod in m.modules())
    assert not any(hasattr(mod, "fp8_format") for mod in m.modules() if type(mod) is nn.Linear)


@pytest.fixture
def torch_references():
    """The model's ops on their PyTorch references (the interpreted Triton kernels are slow here)."""
    import hydra_kernels

    was = hydra_kernels.use_triton_kernels()
    hydra_kernels.set_use_triton_kernels(False)
    yield
    hydra_kernels.set_use_triton_kernels(was)


def test_fp8_model_runs_under_autocast_and_reverts_exactly(torch_references):
    m = tiny_model()
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    m.threshold_commit = "manual"  # no commits: every forward routes with the same thresholds
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = m(x, x).loss.float()
        swap_to_fp8(m, "e4m3", rowwise=True)
        out = m(x, x)
        out.loss.backward()
        revert_fp8(m)
        again = m(x, x).loss.float()
    assert torch.isfinite(out.loss) and all(
        torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None
    )
    # at initialisation the loss is ≈ ln V whatever the rounding; FP8 must not move it by more than
    # the stated loss tolerance u8/4 (relative)
    assert abs(out.loss.float() - ref) / ref <= FP8_FORMATS["e4m3"][2] / 4
    assert torch.equal(again, ref)
