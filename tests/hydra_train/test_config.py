"""TrainConfig: automatic values per device and mode, validation messages, dict round trip."""

from __future__ import annotations

import pytest

from hydra_train.config import DeviceInfo, TrainConfig, model_id_for, resolve_config
from hydra_train.errors import HydraTrainError

CPU = DeviceInfo("cpu")
H100 = DeviceInfo("cuda", 79.2, True)
SMALL_GPU = DeviceInfo("cuda", 16.0, True)


def test_cpu_defaults_are_the_quick_main_job():
    c = resolve_config(TrainConfig(), CPU)
    assert (c.model_size, c.dataset, c.vocab_size, c.precision) == ("tiny", "stdlib", 4096, "fp32")
    assert (c.batch_size, c.seq_len, c.max_steps) == (8, 128, 120)
    assert c.warmup_steps == 6 and c.lr == 3e-3
    assert None not in (c.eval_every, c.log_every, c.save_every)


def test_gpu_picks_size_by_memory_and_bf16():
    c = resolve_config(TrainConfig(), H100)
    assert (c.model_size, c.dataset, c.vocab_size, c.precision, c.lr) == (
        "100M",
        "stdlib-full",
        32000,
        "bf16",
        6e-4,
    )
    assert resolve_config(TrainConfig(), SMALL_GPU).model_size == "debug"
    assert resolve_config(TrainConfig(), DeviceInfo("cuda", 8.0, False)).precision == "fp32"


def test_flags_and_mode_override_defaults():
    c = resolve_config(TrainConfig(mode="production", max_steps=7, model_size="debug", dataset="x"), CPU)
    assert c.max_steps == 7 and c.eval_every == 1000 and c.save_every == 1000 and c.log_every == 50
    assert c.vocab_size is None  # a named dataset brings its own vocabulary
    assert c.warmup_steps == 1 and c.lr == 1e-3


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(mode="fast"), "--mode 'fast' is not one of"),
        (dict(lr_schedule="linear"), "--lr_schedule"),
        (dict(batch_size=0), "--batch_size must be > 0"),
        (dict(checkpoint_every=-1), "--checkpoint_every must be >= 0"),
        (dict(min_lr_ratio=1.5), "--min_lr_ratio"),
        (dict(precision="bf16"), "needs a CUDA device"),
        (dict(fsdp=True, compile=True, compile_scope="model"), "--fsdp compiles each block"),
        (dict(ddp_grad_sync="nccl"), "--ddp_grad_sync 'nccl' is not one of"),
        (dict(ddp_grad_sync="allreduce", fsdp=True), "FSDP2 reduces its sharded gradients itself"),
    ],
)
def test_bad_values_say_which_flag(kw, needle):
    with pytest.raises(HydraTrainError, match=needle.replace("(", r"\(")):
        resolve_config(TrainConfig(**kw), CPU)


def test_dict_round_trip_ignores_unknown_keys():
    c = resolve_config(TrainConfig(model_overrides={"dim": 64}), CPU)
    d = c.to_dict()
    assert TrainConfig.from_dict({**d, "from_the_future": 1}) == c
    assert model_id_for("100M") == "100m"
