"""A flag whose value alone is wrong is a usage error: exit 2, one line, said before anything is
done (no data read, no tokenizer trained, not even the torch.compile / CPU threads lines)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import hydra_train.build as build_mod
import hydra_train.run as run_mod
from hydra_train.cli import app
from hydra_train.config import DeviceInfo, TrainConfig, resolve_config
from hydra_train.errors import HydraUsageError

runner = CliRunner()

BAD = [
    (["--model_size", "huge"], "--model_size 'huge' is not a preset"),
    (["--model_size", "100m"], "--model_size '100m' is not a preset (did you mean 100M?)"),
    (["--model_override", "foo=1"], "unknown HydraConfig field"),
    (["--model_override", "dim=abc"], "dim='abc' must be an integer"),
    (["--vocab_size", "100"], "--vocab_size 100 is too small for the byte-level BPE"),
    (
        ["--seq_len", "2048"],
        "--seq_len 2048 is longer than the model's max_seq_len 1024; pass --seq_len 1024 or less, "
        "or give the model more positions with --model_override max_seq_len=2048",
    ),
    (["--arch", "foo"], "--arch 'foo' is not one of"),
    (["--max_steps", "0"], "--max_steps must be > 0"),
    (["--batch_size", "0"], "--batch_size must be > 0"),
    (["--model_override", "dim"], "expected FIELD=VALUE"),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_flag_values_exit_2_before_any_work(args, message, monkeypatch, tmp_path):
    def must_not_load(*a, **k):
        raise AssertionError("the data was loaded before the flags were checked")

    monkeypatch.setattr(run_mod, "load_run_data", must_not_load)
    monkeypatch.setattr(build_mod, "load_data", must_not_load)
    base = ["run", "--device", "cpu", "--checkpoint_dir", str(tmp_path / "ck"), "--max_steps", "3"]
    res = runner.invoke(app, [*base, *args], env={"COLUMNS": "400"})
    flat = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert message in flat and flat.count("error:") == 1
    # nothing was resolved, announced or made before the refusal
    assert "torch.compile" not in res.output and "CPU threads" not in res.output
    assert not (tmp_path / "ck").exists()


def test_pretest_usage_errors_exit_2_too(tmp_path):
    args = ["pretest", "--model_size", "huge", "--device", "cpu", "--checkpoint_dir", str(tmp_path)]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "--model_size 'huge' is not a preset" in res.output


def test_dry_run_refuses_a_seq_len_the_model_cannot_take():
    res = runner.invoke(app, ["run", "--dry_run", "--device", "cpu", "--seq_len", "4096"])
    assert res.exit_code == 2, res.output
    assert "--model_override max_seq_len=4096" in " ".join(res.output.split())


def test_seq_len_is_checked_against_the_overridden_max_seq_len():
    cpu = DeviceInfo("cpu")
    # a model given more positions takes the longer windows
    cfg = TrainConfig(seq_len=2048, model_overrides={"max_seq_len": 2048})
    assert resolve_config(cfg, cpu).seq_len == 2048
    # an automatic --seq_len on the embedded corpus is held to an override that shortens the model
    with pytest.raises(HydraUsageError, match="--seq_len 128 is longer than the model's max_seq_len 64"):
        resolve_config(TrainConfig(model_overrides={"max_seq_len": 64}), cpu)
    # other data may be rows of their own length (checked once read): an automatic value waits
    resolve_config(TrainConfig(dataset="some/folder", model_overrides={"max_seq_len": 64}), cpu)


def test_small_vocab_is_refused_only_where_a_bpe_is_trained():
    cpu = DeviceInfo("cpu")
    for name in ("stdlib", "stdlib-full", "pyenv"):
        with pytest.raises(HydraUsageError, match="--vocab_size 299 is too small"):
            resolve_config(TrainConfig(dataset=name, vocab_size=299), cpu)
    # token-id data brings its own vocabulary, which may be small
    assert resolve_config(TrainConfig(dataset="ids/", vocab_size=100), cpu).vocab_size == 100


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="gpt", moe=True),
        dict(experimental_loss_spike_threshold=0.5),
        dict(experimental_throughput_drop_threshold=1.5),
        dict(ddp_grad_sync="allreduce", fsdp=True),
        dict(fsdp=True, compile=True, compile_scope="model"),
    ],
)
def test_flag_combinations_are_usage_errors(kw):
    with pytest.raises(HydraUsageError):
        resolve_config(TrainConfig(**kw), DeviceInfo("cpu"))
