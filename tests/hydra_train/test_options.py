"""hydra-train's environment options live in one object (hydra_train.options): each variable fills
its field, code set with set_train_options wins, a bad value names its variable, and the modules
that used to read os.environ themselves read the object."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hydra_train import options
from hydra_train.corpus import cache_dir
from hydra_train.data_sources import resolve_dataset_path
from hydra_train.distributed import DistInfo, init_distributed, launched_by_torchrun
from hydra_train.errors import HydraOptionsError, HydraTrainError
from hydra_train.options import (
    TorchrunLaunch,
    TrainOptions,
    reset_train_options,
    set_train_options,
    torchrun_launch,
    train_options,
)
from hydra_train.safe_opts.faults import FaultInjector
from hydra_train.safe_opts.registry import NAMES

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "packages" / "hydra-train" / "src" / "hydra_train"

#: the defaults, written out by hand (not taken from the module under test)
DEFAULTS = TrainOptions(
    data_root=None,
    cache_dir=Path.home() / ".cache" / "hydra",
    mem_dump_every=0,
    inject_faults="",
    compile_backend="inductor",
    pinned_attention_backend="",
    wandb_project="hydra",
    wandb_mode="offline",
)

#: variable -> (its text, the field it fills, the value expected there)
READS = {
    "HYDRA_DATA_ROOT": ("/data/corpora", "data_root", Path("/data/corpora")),
    "HYDRA_CACHE_DIR": ("~/hc", "cache_dir", Path.home() / "hc"),
    "HYDRA_MEM_DUMP_EVERY": (" 25 ", "mem_dump_every", 25),
    "HYDRA_SAFEOPTS_INJECT": ("nan_grad:compile@step5", "inject_faults", "nan_grad:compile@step5"),
    "HYDRA_COMPILE_BACKEND": ("aot_eager", "compile_backend", "aot_eager"),
    "HYDRA_ATTENTION_BACKEND": ("sdpa", "pinned_attention_backend", "sdpa"),
    "WANDB_PROJECT": ("mine", "wandb_project", "mine"),
    "WANDB_MODE": ("online", "wandb_mode", "online"),
}


@pytest.fixture(autouse=True)
def _no_options_from_code():
    reset_train_options()
    yield
    reset_train_options()


def test_unset_and_empty_variables_give_the_defaults():
    assert train_options({}) == DEFAULTS
    assert train_options({name: "" for name in READS}) == DEFAULTS


def test_every_variable_fills_its_field():
    assert sorted(READS) == sorted(v.name for v in options.VARIABLES)  # the table covers them all
    for name, (text, field, expected) in READS.items():
        got = train_options({name: text})
        assert getattr(got, field) == expected, name
        assert got.__dict__ == {**DEFAULTS.__dict__, field: expected}, name  # and nothing else


def test_the_process_environment_is_read_when_asked(monkeypatch, tmp_path):
    """Read at the point of use, as before: a variable set after import counts."""
    monkeypatch.setenv("HYDRA_MEM_DUMP_EVERY", "7")
    monkeypatch.setenv("HYDRA_COMPILE_BACKEND", "eager")
    assert (train_options().mem_dump_every, train_options().compile_backend) == (7, "eager")
    monkeypatch.delenv("HYDRA_MEM_DUMP_EVERY")
    assert train_options().mem_dump_every == 0


def test_setting_from_code_wins_until_reset(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("HYDRA_MEM_DUMP_EVERY", "ten")  # bad, but not read while code sets it
    monkeypatch.setenv("HYDRA_DATA_ROOT", str(tmp_path))
    set_train_options(cache_dir=tmp_path / "code", mem_dump_every=3, data_root=None)
    got = train_options()
    assert (got.cache_dir, got.mem_dump_every, got.data_root) == (tmp_path / "code", 3, None)
    assert cache_dir() == tmp_path / "code"  # and the module that used to read the variable follows
    reset_train_options("cache_dir", "data_root")
    assert (train_options().cache_dir, train_options().data_root) == (tmp_path / "env", tmp_path)
    reset_train_options()
    with pytest.raises(HydraOptionsError, match="HYDRA_MEM_DUMP_EVERY='ten'"):
        train_options()


@pytest.mark.parametrize("text", ["ten", "-3", "2.5"])
def test_a_bad_variable_names_itself(monkeypatch, text):
    monkeypatch.setenv("HYDRA_MEM_DUMP_EVERY", text)
    with pytest.raises(HydraOptionsError) as err:
        train_options()
    assert str(err.value) == (
        f"environment variable HYDRA_MEM_DUMP_EVERY={text!r}: expected a whole number >= 0; "
        "fix it or unset it"
    )
    # one line through the CLI's error handling, as every HydraTrainError; and still a ValueError
    assert isinstance(err.value, HydraTrainError) and isinstance(err.value, ValueError)


def test_bad_values_from_code_name_the_field_and_its_variable():
    with pytest.raises(HydraOptionsError, match=r"mem_dump_every=-1\) \(HYDRA_MEM_DUMP_EVERY\)"):
        set_train_options(mem_dump_every=-1)
    with pytest.raises(HydraOptionsError, match=r"mem_dump_every=True"):
        set_train_options(mem_dump_every=True)
    with pytest.raises(HydraOptionsError, match=r"cache_dir=3\) \(HYDRA_CACHE_DIR\): expected a path"):
        set_train_options(cache_dir=3)
    with pytest.raises(HydraOptionsError, match="no option cache; the options are data_root, cache_dir"):
        set_train_options(cache=".")
    with pytest.raises(HydraOptionsError, match="no option 'nope'"):
        reset_train_options("nope")
    with pytest.raises(HydraOptionsError):  # all or nothing: the good value is not kept either
        set_train_options(compile_backend="eager", mem_dump_every="x")
    assert train_options({}) == DEFAULTS


def test_a_bad_variable_stops_hydra_train_run_in_one_line(monkeypatch, tmp_path):
    from hydra_train.cli import app

    monkeypatch.setenv("HYDRA_MEM_DUMP_EVERY", "ten")
    res = CliRunner().invoke(app, ["run", "--max_steps", "1", "--checkpoint_dir", str(tmp_path / "ck")])
    assert res.exit_code == 1
    assert "HYDRA_MEM_DUMP_EVERY='ten'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "ck").exists()  # stopped before anything was built


def test_the_modules_read_the_options(tmp_path):
    from hydra_train.artifacts import ArtifactsCallback
    from hydra_train.safe_opts.toggles import CompileModel, FlashAttention

    (tmp_path / "corpus").mkdir()
    set_train_options(
        data_root=tmp_path,
        mem_dump_every=5,
        inject_faults="slow=0.1:compile@always",
        compile_backend="aot_eager",
        pinned_attention_backend="sdpa",
    )
    assert resolve_dataset_path("corpus") == tmp_path / "corpus"
    assert ArtifactsCallback(artifacts=None).mem_every == 5
    assert FaultInjector.from_options(NAMES).faults[0].value == 0.1
    assert CompileModel(cfg=None).backend == "aot_eager"
    reason = FlashAttention(cfg=None).not_applicable(trainer=None)
    assert reason == "HYDRA_ATTENTION_BACKEND=sdpa is set: the environment chooses the backend"
    set_train_options(inject_faults="")
    assert FaultInjector.from_options(NAMES) is None


def test_torchrun_variables_through_one_helper(monkeypatch):
    assert torchrun_launch({}) == TorchrunLaunch(launched=False, rank=0, world_size=1, local_rank=0)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert torchrun_launch(env) == TorchrunLaunch(launched=True, rank=3, world_size=4, local_rank=1)
    assert not torchrun_launch({"RANK": "0"}).launched  # both RANK and WORLD_SIZE, as torchrun sets
    with pytest.raises(HydraOptionsError, match="environment variable LOCAL_RANK='x' is not a whole number"):
        torchrun_launch({"LOCAL_RANK": "x"})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched_by_torchrun() and init_distributed("cpu") == DistInfo()  # one process: no group


def test_only_the_options_module_reads_the_environment():
    reads = re.compile(r"os\.environ|getenv")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "options.py" or p.parent != SRC
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if reads.search(line)
    ]
    assert not offenders, f"read the environment through hydra_train.options: {offenders}"


def test_every_variable_is_documented():
    readme = (ROOT / "packages" / "hydra-train" / "README.md").read_text(encoding="utf-8")
    for var in options.VARIABLES:
        assert f"``{var.name}`` (``{var.field}``)" in options.__doc__, var.name
        assert f"`{var.name}`" in readme, var.name
