"""hydra_kernels' switches live in one object: the environment and the set_* functions both write
it, and the ops read it (an op switched off there runs its reference)."""

from __future__ import annotations

import torch

import hydra_kernels
from hydra_kernels import controls, launch_config
from hydra_kernels.ops.linear_cross_entropy import (
    linear_ce_options,
    reset_linear_ce_options,
    set_linear_ce_options,
)
from hydra_kernels.options import OPTIONS


def test_the_set_functions_write_the_options_object():
    assert hydra_kernels.kernel_options is OPTIONS
    controls.set_use_triton_kernels(False)
    assert OPTIONS.triton is False and not controls.use_triton_kernels()
    controls.set_op_enabled("rope", True, backward=False)
    assert (OPTIONS.ops["rope"].forward, OPTIONS.ops["rope"].backward) == (True, False)
    controls.set_use_liger_ce(True)
    assert OPTIONS.liger_ce and controls.use_liger_ce()
    controls.set_use_liger_ce(False)
    launch_config.set_blackwell_tuning(False)
    assert OPTIONS.blackwell_tuning is False and not launch_config.blackwell_tuning_enabled()
    launch_config.set_blackwell_tuning(True)
    launch_config.set_launch_overrides("rms_norm", num_warps=2)
    assert OPTIONS.launch_overrides == {"rms_norm": {"num_warps": 2}}
    set_linear_ce_options(chunk_rows=96)
    try:
        assert OPTIONS.linear_ce == {"chunk_rows": 96} and linear_ce_options().chunk_rows == 96
    finally:
        reset_linear_ce_options()
    assert OPTIONS.linear_ce == {}


def test_the_environment_fills_the_options_object(monkeypatch):
    monkeypatch.setenv("HYDRA_DISABLE_TRITON", "1")
    monkeypatch.setenv("HYDRA_DISABLE_FUSED_SWIGLU_BWD", "1")
    monkeypatch.setenv("HYDRA_ENABLE_FUSED_ROPE", "0")
    monkeypatch.setenv("HYDRA_TRITON_NUM_WARPS", "8")
    controls.reload_env()
    assert OPTIONS.triton is False
    assert (OPTIONS.ops["swiglu"].forward, OPTIONS.ops["swiglu"].backward) == (True, False)
    assert OPTIONS.ops["rope"].forward is False and OPTIONS.ops["rope"].backward is False
    assert OPTIONS.launch_env == {"num_warps": 8}
    cfg = launch_config.resolve_launch_config(
        "x", torch.device("cpu"), {"default": launch_config.LaunchConfig()}
    )
    assert cfg.num_warps == 8
    status = controls.get_kernel_status()
    assert status["use_triton_kernels"] is False and status["ops"]["rope"]["enabled"] is False


def test_an_op_switched_off_in_the_options_runs_its_reference():
    x = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    angles = torch.randn(5, 4, dtype=torch.float64)
    if controls.device_supports_triton(x.device):  # the interpreter: the kernel would run
        assert controls.triton_path("rope", x)
    OPTIONS.ops["rope"].forward = OPTIONS.ops["rope"].backward = False
    assert not controls.triton_path("rope", x)
    got = hydra_kernels.rope(x, angles.cos(), angles.sin())
    assert torch.equal(got, hydra_kernels.rope_ref(x, angles.cos(), angles.sin()))
