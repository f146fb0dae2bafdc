"""eager_apply (_custom_op.py): an op's autograd.Function is skipped where nothing will be
differentiated (no grad mode, or no input that requires grad), its forward run alone: the same
output, bitwise, as through the Function; with an input that requires grad the Function runs and
its backward works. Triton kernels interpreted on the CPU, fresh random inputs."""

import pytest
import torch

from hydra_kernels import fused_add_rms_norm, qk_norm, rms_norm, rope, swiglu, swiglu_packed
from hydra_kernels.ops import qk_norm as qk_mod
from hydra_kernels.ops import rms_norm as rms_mod
from hydra_kernels.ops import rope as rope_mod
from hydra_kernels.ops import swiglu as swiglu_mod

from .conftest import DEVICE, NEEDS_TRITON

pytestmark = NEEDS_TRITON


def cases():
    x = torch.randn(3, 5, 4, 16, device=DEVICE)
    w = torch.rand(16, device=DEVICE) + 0.5
    cos, sin = torch.randn(5, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    temp = torch.randn(4, device=DEVICE)
    gu = torch.randn(6, 32, device=DEVICE)
    return {
        "rms_norm": (rms_mod._RMSNormFunction, lambda: rms_norm(x, w), (x, w)),
        "fused_add_rms_norm": (
            rms_mod._FusedAddRMSNormFunction,
            lambda: fused_add_rms_norm(x, x * 0.5, w),
            (x, w),
        ),
        "qk_norm": (qk_mod._QKNormFunction, lambda: qk_norm(x, 4.0, temp), (x, temp)),
        "rope": (rope_mod._RopeEager, lambda: rope(x, cos, sin), (x,)),
        "swiglu": (swiglu_mod._SwiGLUEager, lambda: swiglu(gu[:, :16], gu[:, 16:]), (gu,)),
        "swiglu_packed": (swiglu_mod._SwiGLUPackedEager, lambda: swiglu_packed(gu), (gu,)),
    }


@pytest.mark.parametrize("op", list(cases()))
def test_no_differentiation_skips_the_function_and_keeps_the_output(op, monkeypatch):
    function, call, inputs = cases()[op]
    calls = []
    real = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        bare = call()
    plain = call()  # grad mode on, but no input requires grad
    assert not calls
    for t in inputs:
        t.requires_grad_(True)
    through = call()
    assert calls  # an input requires grad: the Function ran
    outs = [o if isinstance(o, tuple) else (o,) for o in (bare, plain, through)]
    for a, b, c in zip(*outs, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c.detach())  # the same forward, bitwise
    first = outs[2][0]
    assert first.requires_grad
    first.float().square().sum().backward()
    assert all(t.grad is not None for t in inputs)
    with torch.no_grad():
        call()
    assert len(calls) == 1  # grad mode off: skipped even with inputs that require grad
