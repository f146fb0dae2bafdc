"""hydra_kernels.checks: the generic fp64 check behind `hydra-kernels check`.

The check must pass working kernels, and must fail a kernel that is slightly wrong or that falls
back to its reference.
"""

import pytest
import torch

from hydra_kernels import checks, controls
from hydra_kernels.ops import swiglu as sw

INTERPRETED = controls.device_supports_triton(torch.device("cpu"))


def test_cases_cover_every_op():
    assert {c.control_op for c in checks.CASES} == set(controls.OPS)
    assert {"rms_norm", "fused_add_rms_norm", "swiglu", "qk_norm", "rope", "linear_cross_entropy"} <= {
        c.name for c in checks.CASES
    }


@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_working_kernels_pass_and_report_the_triton_backend():
    results = checks.run_checks(quick=True, ops=["swiglu", "rope"], device=torch.device("cpu"))
    assert len(results) == 4  # 2 ops x fp32, bf16
    for r in results:
        assert r.passed, r
        assert r.backend == "triton" and r.error is None
        assert 0 <= r.worst_ratio <= 1
        assert set(r.items) == ({"out0", "grad[0]", "grad[1]"} if r.op == "swiglu" else {"out0", "grad[0]"})


@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_a_slightly_wrong_kernel_fails(monkeypatch):
    real = sw._launch_swiglu_fwd
    monkeypatch.setattr(sw, "_launch_swiglu_fwd", lambda g, u: real(g, u) * 1.01)
    (r,) = checks.run_checks(quick=True, ops=["swiglu"], dtypes=["fp32"], device=torch.device("cpu"))
    assert not r.passed and r.worst_item == "out0" and r.worst_ratio > 1
    assert "FAIL" in r.items["out0"] and r.items["grad[0]"].startswith("ok")


@pytest.mark.fallback_expected
@pytest.mark.skipif(not INTERPRETED, reason="needs the Triton interpreter on the CPU")
def test_a_kernel_that_falls_back_fails_the_check(monkeypatch):
    def broken(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(sw, "_launch_swiglu_bwd", broken)
    with pytest.warns(RuntimeWarning, match="simulated kernel failure"):
        (r,) = checks.run_checks(quick=True, ops=["swiglu"], dtypes=["bf16"], device=torch.device("cpu"))
    assert not r.passed and "reference answered" in r.error


def test_references_only_mode_is_said_and_checked():
    controls.set_use_triton_kernels(False)
    assert checks.check_mode(torch.device("cpu")).startswith("references only")
    results = checks.run_checks(
        quick=True, ops=["swiglu"], dtypes=["fp32"], device=torch.device("cpu"), seed=3
    )
    assert results[0].backend == "reference" and results[0].passed and results[0].seed == 3


def test_keep_float64_mode_only_touches_float64_to_float32_casts():
    x64, x32 = torch.randn(3, dtype=torch.float64), torch.randn(3)
    with checks._KeepFloat64():
        assert x64.float() is x64 and x64.to(torch.float32) is x64 and x64.to(dtype=torch.float32) is x64
        assert x32.float().dtype == torch.float32 and x64.to(torch.bfloat16).dtype == torch.bfloat16
        assert x32.double().dtype == torch.float64
    assert x64.float().dtype == torch.float32


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown op"):
        checks.run_checks(ops=["nope"])
    with pytest.raises(ValueError, match="unknown dtype"):
        checks.run_checks(dtypes=["fp8"])


def test_criterion_with_elementwise_extra_tolerance():
    r = torch.linspace(-1, 1, 9, dtype=torch.float64)
    t = r.clone()  # torch exact: only atol is left
    k = r.clone()
    k[3] += 1e-3
    extra = torch.zeros(9, dtype=torch.float64)
    assert not checks._criterion(k, t, r, extra, "elementwise").passed
    extra[3] = 2e-3  # a documented per-element allowance covers it, and only there
    assert checks._criterion(k, t, r, extra, "elementwise").passed
    k[5] += 1e-3
    assert not checks._criterion(k, t, r, extra, "elementwise").passed
    assert checks._criterion(k, t, r, 2e-3, "elementwise").passed  # a plain number works too


def test_owner_specific_criteria_are_wired():
    by_name = {c.name: c for c in checks.CASES}
    assert by_name["fused_add_rms_norm"].half_reduction == "max"
    assert by_name["linear_cross_entropy"].grad_atol is not None
    assert by_name["swiglu"].half_reduction == "elementwise" and by_name["rope"].grad_atol is None
