"""`hydra-train run --arch gpt` end to end on the CPU: train, resume, refuse an arch mismatch,
then `hydra-model generate` from the checkpoint it wrote."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hydra_model import GPTModel, load_model
from hydra_model.cli import app as model_app
from hydra_train.callbacks import TrainerCallback
from hydra_train.cli import app
from hydra_train.config import DeviceInfo, TrainConfig, model_id_for, resolve_config
from hydra_train.errors import HydraTrainError

from .conftest import VOCAB

runner = CliRunner()

#: the tiny GPT preset, narrowed so that a step takes milliseconds
GPT_OVERRIDES = {"dim": 64, "n_layers": 2, "head_dim": 16, "mlp_hidden": 128, "max_seq_len": 64}


def _args(data, ckpt, arch: str, overrides: dict, *extra: str) -> list[str]:
    args = ["run", "--arch", arch, "--model_size", "tiny", "--dataset", str(data)]
    args += ["--vocab_size", str(VOCAB), "--seq_len", "32", "--batch_size", "4", "--max_steps", "4"]
    args += ["--log_every", "2", "--eval_every", "2", "--eval_batches", "2", "--save_every", "2"]
    args += ["--checkpoint_dir", str(ckpt), "--device", "cpu", "--cpu_threads", "1"]
    args += ["--experimental_prefetch_threads", "0", "--lr", "3e-3", "--warmup_steps", "1"]
    for k, v in overrides.items():
        args += ["--model_override", f"{k}={v}"]
    return args + list(extra)


def _tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_gpt_trains_resumes_refuses_other_arch_and_generates(bin_dataset, tmp_path):
    ck = tmp_path / "ck"
    res = runner.invoke(app, _args(bin_dataset, ck, "gpt", GPT_OVERRIDES, "--json"))
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{") :])
    assert summary["arch"] == "gpt" and summary["steps"] == 4
    assert summary["final_val_loss"] < summary["first_val_loss"]
    final = ck / "hydra_gpt-tiny_final.pt"
    assert final.is_file() and (ck / "hydra_gpt-tiny_step2.pt").is_file()
    blob = torch.load(final, weights_only=True)
    assert blob["config"]["train"]["arch"] == "gpt" and blob["config"]["model"]["n_layers"] == 2

    # resume continues the same run to the new max
    res = runner.invoke(app, [*_args(bin_dataset, ck, "gpt", GPT_OVERRIDES), "--resume", "--max_steps", "6"])
    assert res.exit_code == 0, res.output
    assert "resuming from" in res.output and "hydra_gpt-tiny_final.pt (step 4" in res.output
    assert torch.load(final, weights_only=True)["step"] == 6

    # a HYDRA run asked to resume where only the GPT's checkpoints are: one clear line naming the
    # flags they were saved with, exit 1
    res = runner.invoke(app, [*_args(bin_dataset, ck, "hydra", {"dim": 64, "max_seq_len": 64}), "--resume"])
    flat = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "holds no checkpoint of model tiny" in flat
    assert "only of gpt-tiny (--arch gpt --model_size tiny): resume with those flags" in flat
    assert flat.count("error:") == 1 and "Traceback" not in res.output

    # hydra-model generate picks the class from the checkpoint and decodes like the model itself
    _tokenizer(tmp_path / "tok.json")
    gen = ["generate", "--checkpoint", str(final), "--tokenizer", str(tmp_path / "tok.json")]
    gen += ["--prompt", "the cat sat", "--max_new_tokens", "5", "--device", "cpu", "--json"]
    res = runner.invoke(model_app, gen)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    model = load_model(final)
    assert isinstance(model, GPTModel)
    want = model.generate(torch.tensor([data["prompt_ids"]]), 5)[0, 3:].tolist()
    assert data["generated_ids"] == want and len(want) == 5


def test_arch_flags_are_checked():
    dev = DeviceInfo("cpu")
    assert resolve_config(TrainConfig(arch="gpt"), dev).arch == "gpt"
    with pytest.raises(HydraTrainError, match="--arch 'llama' is not one of: hydra, gpt"):
        resolve_config(TrainConfig(arch="llama"), dev)
    with pytest.raises(HydraTrainError, match="--moe applies to --arch hydra only"):
        resolve_config(TrainConfig(arch="gpt", moe=True), dev)
    with pytest.raises(HydraTrainError, match="--static_routing_mode applies to --arch hydra only"):
        resolve_config(TrainConfig(arch="gpt", static_routing_mode=True), dev)
    assert model_id_for("100M") == "100m" and model_id_for("100M", "gpt") == "gpt-100m"
    assert TrainConfig.from_dict({"model_size": "tiny"}).arch == "hydra"  # older checkpoints


def test_gpt_model_builds_from_train_config_with_chunked_ce():
    from hydra_train.run import build_model

    cfg = TrainConfig(arch="gpt", model_size="tiny", chunked_ce=True, model_overrides=dict(GPT_OVERRIDES))
    model = build_model(cfg, VOCAB, torch.device("cpu"))
    assert isinstance(model, GPTModel) and model.config.use_chunked_ce and model.config.vocab_size == VOCAB
    with pytest.raises(HydraTrainError, match="unknown GPTConfig field"):
        build_model(cfg.replace(model_overrides={"mod_capacity": 0.5}), VOCAB, torch.device("cpu"))


def test_pretest_runs_on_the_gpt_and_compile_targets_its_layers(tmp_path):
    from hydra_train.run import build_model
    from hydra_train.safe_opts.standalone import request_all
    from hydra_train.safe_opts.toggles import compile_units

    args = ["pretest", "--arch", "gpt", "--model_size", "tiny", "--seq_len", "16", "--batch_size", "2"]
    args += ["--device", "cpu", "--cpu_threads", "1", "--pretest_warmup_steps", "1", "--pretest_steps", "2"]
    args += ["--only", "prefetch_threads", "--log_dir", str(tmp_path), "--json"]
    for k, v in GPT_OVERRIDES.items():
        args += ["--model_override", f"{k}={v}"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["results"]["prefetch_threads"]["status"] == "PASS"
    # --all requests static routing only where there is routing
    assert request_all(TrainConfig(arch="gpt")).static_routing_mode is False
    assert request_all(TrainConfig(arch="hydra")).static_routing_mode is True
    model = build_model(
        TrainConfig(arch="gpt", model_size="tiny", model_overrides=dict(GPT_OVERRIDES)), VOCAB, "cpu"
    )
    assert compile_units(model) == list(model.layers)


class CrashAt(TrainerCallback):
    name = "crash"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, step, metrics):
        if step == self.step:
            raise RuntimeError("simulated crash")


def test_gpt_resume_equals_the_uninterrupted_run(bin_dataset, tmp_path):
    """6 steps straight, or a crash at step 4 and a resume from the step-3 checkpoint: the same
    final weights and validation losses, bit for bit."""
    from hydra_train.run import run_training

    from .conftest import tiny_config

    def cfg(folder, **kw):
        kw = {"max_steps": 6, "save_every": 3, "eval_every": 3, **kw}
        return tiny_config(
            bin_dataset, tmp_path / folder, arch="gpt", model_overrides=dict(GPT_OVERRIDES), **kw
        )

    run_training(cfg("a"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg("b"), callbacks=[CrashAt(4)])
    assert sorted(p.name for p in (tmp_path / "b").glob("*.pt")) == ["hydra_gpt-tiny_step3.pt"]
    s = run_training(cfg("b", resume=True))
    assert s["resumed_from"] is not None and s["arch"] == "gpt" and s["steps"] == 6
    a = torch.load(tmp_path / "a" / "hydra_gpt-tiny_final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "hydra_gpt-tiny_final.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert [v for _, v in a["trainer"]["val_history"]] == [v for _, v in b["trainer"]["val_history"]]
