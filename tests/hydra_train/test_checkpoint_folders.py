"""Checkpoint folders: ``--resume`` sees only this model's checkpoints and refuses where there is
none, a fresh run in a used folder keeps its own checkpoints and supersedes the earlier run, a
resume refuses settings that would change the data stream (or converts the position exactly), and
the skip streak survives a resume."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hydra_train.callbacks import TrainerCallback
from hydra_train.checkpoint import resume_data_position
from hydra_train.cli import app
from hydra_train.errors import HydraCheckpointError, HydraDivergedError
from hydra_train.run import run_training
from hydra_train.trainer_state import TrainerStateMixin

from .conftest import VOCAB, tiny_config
from .test_arch_gpt import GPT_OVERRIDES
from .test_trainer import CrashAt, Recorder


def _snapshot(folder):
    """Every file's bytes: what a refusal must leave as it was."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


class Positions(TrainerCallback):
    """The loader's position when training starts (after any resume)."""

    name = "positions"

    def on_train_start(self, trainer):
        self.start = trainer.loader.position


class NaNFrom(TrainerCallback):
    """A non-finite gradient at every step of ``steps``."""

    name = "nan_from"

    def __init__(self, steps):
        self.steps = set(steps)

    def on_after_backward(self, step, model):
        if step in self.steps:
            p = next(p for p in model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


# -- item 1: --resume sees only this model's checkpoints ---------------------------------------


def test_resume_ignores_a_newer_checkpoint_of_another_model(bin_dataset, tmp_path):
    run_training(tiny_config(bin_dataset, tmp_path, max_steps=4, save_every=2))
    gpt = dict(arch="gpt", model_overrides=dict(GPT_OVERRIDES))
    run_training(tiny_config(bin_dataset, tmp_path, max_steps=2, save_every=2, **gpt))  # newer, other model
    s = run_training(tiny_config(bin_dataset, tmp_path, max_steps=6, save_every=2, resume=True))
    assert s["status"] == "finished" and s["steps"] == 6 and s["resumed_from"] is not None
    assert torch.load(tmp_path / "hydra_tiny_final.pt", weights_only=True)["step"] == 6
    assert torch.load(tmp_path / "hydra_gpt-tiny_final.pt", weights_only=True)["step"] == 2  # untouched


# -- item 2: a fresh run in a folder of an earlier run of the model supersedes it ---------------


def test_a_fresh_run_in_a_used_folder_keeps_its_checkpoints_and_resumes_as_itself(bin_dataset, tmp_path):
    """Pruning went by step number: run B's step-2 checkpoint was deleted as it was written (A's
    steps 6 and 8 were higher), and a --resume after B's crash continued A (from its final)."""
    run_training(tiny_config(bin_dataset, tmp_path, max_steps=8, save_every=2, keep_checkpoints=2))
    b = dict(max_steps=8, save_every=2, keep_checkpoints=2, seed=7)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(tiny_config(bin_dataset, tmp_path, **b), callbacks=[CrashAt(3)])
    names = sorted(p.name for p in tmp_path.glob("hydra_tiny_*.pt"))
    # B's step 2 kept, with A's last one (keep 2); A's step 4 pruned
    assert names == ["hydra_tiny_final.pt", "hydra_tiny_step2.pt", "hydra_tiny_step6.pt"]
    positions = Positions()
    run_training(tiny_config(bin_dataset, tmp_path, resume=True, **b), callbacks=[positions])
    assert positions.start == 2  # B's step 2 (A's final would have started at 8, with nothing left)
    final = torch.load(tmp_path / "hydra_tiny_final.pt", weights_only=True)
    assert final["step"] == 8 and final["data"]["seed"] == 7  # B's run went on to its end


def test_the_same_command_twice_in_one_folder_runs_twice(bin_dataset, tmp_path):
    """The README's command run again (the default --checkpoint_dir): the second run trains too."""
    args = ["run", "--dataset", str(bin_dataset), "--vocab_size", str(VOCAB), "--seq_len", "32"]
    args += ["--batch_size", "4", "--max_steps", "2", "--eval_batches", "1", "--device", "cpu"]
    args += ["--checkpoint_dir", str(tmp_path), "--model_size", "tiny", "--cpu_threads", "1"]
    args += ["--model_override", "dim=64", "--model_override", "max_seq_len=64"]
    runner = CliRunner()
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    before = (tmp_path / "hydra_tiny_final.pt").stat().st_mtime_ns
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert (tmp_path / "hydra_tiny_final.pt").stat().st_mtime_ns > before


# -- item 3: settings that decide the data stream ----------------------------------------------


@pytest.fixture
def crashed_at_3(bin_dataset, tmp_path):
    """A run of batch 4 that saved step 2 (position 2: 8 windows read) and crashed at step 3."""
    cfg = tiny_config(bin_dataset, tmp_path, max_steps=4, save_every=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, callbacks=[CrashAt(3)])
    return cfg


def test_resume_with_another_seed_is_refused_naming_the_saved_value(crashed_at_3, tmp_path):
    before = _snapshot(tmp_path)
    with pytest.raises(HydraCheckpointError, match=r"--seed 99 \(checkpoint: 1337\)"):
        run_training(crashed_at_3.replace(resume=True, seed=99))
    assert _snapshot(tmp_path) == before


def test_resume_with_a_batch_size_that_splits_a_batch_is_refused(crashed_at_3, tmp_path):
    with pytest.raises(HydraCheckpointError) as exc:
        run_training(crashed_at_3.replace(resume=True, batch_size=3))
    msg = str(exc.value)
    assert "--batch_size 3 x world size 1 (checkpoint: 4 x 1)" in msg and "the 8 windows read" in msg


def test_resume_with_a_batch_size_that_divides_the_windows_read_converts_the_position(crashed_at_3, capsys):
    pos = Positions()
    s = run_training(crashed_at_3.replace(resume=True, batch_size=8), callbacks=[pos])
    assert s["status"] == "finished" and s["steps"] == 4
    assert pos.start == 1  # 8 windows read = one micro-batch of 8: none skipped, none read twice
    out = " ".join(capsys.readouterr().out.split())
    assert "the 8 windows read so far continue at micro-batch 1 of the new size" in out


def test_resume_says_when_grad_accum_or_the_schedule_changes(crashed_at_3, capsys):
    pos = Positions()
    run_training(crashed_at_3.replace(resume=True, grad_accum=2, max_steps=5), callbacks=[pos])
    assert pos.start == 2  # the position counts micro-batches: unchanged
    out = " ".join(capsys.readouterr().out.split())
    assert "--grad_accum 2 (checkpoint: 1)" in out
    assert "learning-rate schedule follows this run's --max_steps 5 (checkpoint: 4) from step 2" in out


def _ck(data, train=None):
    return {"data": data, "config": {"train": train or {}}}


def test_resume_data_position_across_world_sizes_and_older_checkpoints(bin_dataset, tmp_path):
    cfg = tiny_config(bin_dataset, tmp_path, batch_size=4, seed=5)
    saved = {"position": 3, "seed": 5, "batch_size": 4, "seq_len": 32, "world_size": 2}
    # 2 ranks x 4 = 24 windows read; 4 ranks x 2 -> the same 8 a micro-batch: same position
    assert resume_data_position(_ck(saved), cfg.replace(batch_size=2), 4, tmp_path)[0] == 3
    assert resume_data_position(_ck(saved), cfg, 3, tmp_path)[0] == 2  # 24 / 12
    with pytest.raises(HydraCheckpointError, match=r"world size 4 \(checkpoint: 4 x 2\)"):
        resume_data_position(_ck(saved), cfg, 4, tmp_path)  # 24 / 16
    with pytest.raises(HydraCheckpointError, match=r"--seq_len 32 \(checkpoint: 64\)"):
        resume_data_position(_ck({**saved, "seq_len": 64}), cfg, 2, tmp_path)
    # older files: no batch/seq/world entries in "data" -> the saved train config, else unchecked
    old = {"position": 3, "seed": 5}
    assert resume_data_position(_ck(old), cfg, 1, tmp_path) == (3, [])
    assert resume_data_position(_ck({**old, "position": 4}, {"batch_size": 2}), cfg, 1, tmp_path)[0] == 2
    with pytest.raises(HydraCheckpointError, match=r"--seq_len 32 \(checkpoint: 16\)"):
        resume_data_position(_ck(old, {"seq_len": 16}), cfg, 1, tmp_path)


# -- item 4: --resume where there is nothing of this model to resume ---------------------------


def test_resume_of_a_missing_folder_is_refused_and_creates_nothing(bin_dataset, tmp_path):
    typo = tmp_path / "chekpoints"
    with pytest.raises(HydraCheckpointError, match="does not exist; check the path, or drop --resume"):
        run_training(tiny_config(bin_dataset, typo, resume=True))
    assert not typo.exists()


def test_resume_where_only_another_model_saved_names_its_flags(bin_dataset, tmp_path):
    run_training(
        tiny_config(bin_dataset, tmp_path, max_steps=2, arch="gpt", model_overrides=dict(GPT_OVERRIDES))
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(HydraCheckpointError) as exc:
        run_training(tiny_config(bin_dataset, tmp_path, resume=True))
    msg = str(exc.value)
    assert "holds no checkpoint of model tiny" in msg and "drop --resume to start a new run" in msg
    assert "only of gpt-tiny (--arch gpt --model_size tiny)" in msg
    with pytest.raises(
        HydraCheckpointError, match=r"holds no checkpoint of model tiny.*check --checkpoint_dir"
    ):
        run_training(tiny_config(bin_dataset, tmp_path / "empty", resume=True))


def test_resume_help_says_it_is_a_switch():
    res = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 0 and "A switch (no value): continue the run in --checkpoint_dir" in flat


# -- item 5: the skip streak is part of the trainer state --------------------------------------


def test_skip_streak_survives_a_resume(bin_dataset, tmp_path):
    # non-finite steps 3..6 with --max_skipped_steps 3: the uninterrupted run stops at step 6;
    # so must one resumed from step 4 (2 of the streak behind it)
    kw = dict(max_steps=8, save_every=4, log_every=1, max_skipped_steps=3)
    with pytest.raises(HydraDivergedError, match=r"4 steps in a row \(3-6\)"):
        run_training(tiny_config(bin_dataset, tmp_path / "a", **kw), callbacks=[NaNFrom(range(3, 7))])
    cfg = tiny_config(bin_dataset, tmp_path / "b", **kw)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, callbacks=[NaNFrom(range(3, 7)), CrashAt(5)])
    assert (
        int(torch.load(tmp_path / "b" / "hydra_tiny_step4.pt", weights_only=True)["trainer"]["streak"]) == 2
    )
    with pytest.raises(HydraDivergedError, match=r"4 steps in a row \(3-6\)"):
        run_training(cfg.replace(resume=True), callbacks=[NaNFrom(range(3, 7)), Recorder()])


def test_trainer_state_without_a_streak_loads_as_zero():
    class State(TrainerStateMixin):
        device = torch.device("cpu")

    st = State()
    st._init_state(st.device)
    st._streak += 5
    saved = st.state_dict()
    assert int(saved.pop("streak")) == 5
    st.load_state_dict(saved)  # an older checkpoint's trainer entry
    assert int(st._streak) == 0
