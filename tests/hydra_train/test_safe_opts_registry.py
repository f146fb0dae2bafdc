"""The registry: names, risk order, what each flag requests, and the flags' validation."""

from __future__ import annotations

import pytest

from hydra_train.config import DeviceInfo, TrainConfig, resolve_config
from hydra_train.errors import HydraTrainError
from hydra_train.safe_opts.registry import NAMES, THROUGHPUT_DROP, build_registry


def requested(**kw):
    return {n for n, o in build_registry(TrainConfig(**kw)).items() if o.requested()}


def test_names_in_risk_order():
    reg = build_registry(TrainConfig())
    assert tuple(reg) == NAMES and len(NAMES) == 9
    assert NAMES.index("fp8") < NAMES.index("compile") < NAMES.index("prefetch_threads")


def test_defaults_follow_the_seed():
    # fa3, CUDA graphs, Blackwell tuning and 4 prefetch threads on; FP8 off; the rest off by flag
    assert requested() == {"fa3", "cuda_graphs", "blackwell_tuning", "prefetch_threads"}


def test_each_flag_requests_its_optimization():
    base = requested(
        experimental_fa3=False,
        experimental_cuda_graphs=False,
        experimental_blackwell_tuning=False,
        experimental_prefetch_threads=0,
    )
    assert base == set()
    off = dict(
        experimental_fa3=False,
        experimental_cuda_graphs=False,
        experimental_blackwell_tuning=False,
        experimental_prefetch_threads=0,
    )
    for flag, name in [
        ("experimental_fp8", "fp8"),
        ("compile", "compile"),
        ("eight_bit_adam", "8bit_adam"),
        ("triton_kernels", "triton_kernels"),
        ("static_routing_mode", "static_routing"),
    ]:
        assert requested(**off, **{flag: True}) == {name}
    assert requested(**off, model_overrides={"static_routing_mode": True}) == {"static_routing"}


def test_what_each_can_be_blamed_for():
    reg = build_registry(TrainConfig())
    assert reg["prefetch_threads"].causes == {THROUGHPUT_DROP}
    assert len(reg["fp8"].causes) == 5
    assert reg["static_routing"].numerics == "mode" and reg["fp8"].numerics == "fp8"
    assert not reg["cuda_graphs"].probe_differs and reg["compile"].probe_differs


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("fp8_format", "e3m4", "--fp8_format"),
        ("fp8_scaling", "block", "--fp8_scaling"),
        ("compile_scope", "layer", "--compile_scope"),
        ("experimental_loss_spike_threshold", 0.9, "> 1"),
        ("experimental_throughput_drop_threshold", 1.5, "(0, 1)"),
        ("experimental_safety_window", 0, "--experimental_safety_window"),
        ("cuda_graphs_warmup", 0, "--cuda_graphs_warmup"),
    ],
)
def test_bad_values_are_refused(field, value, msg):
    with pytest.raises(HydraTrainError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        resolve_config(TrainConfig(**{field: value}), DeviceInfo("cpu"))
