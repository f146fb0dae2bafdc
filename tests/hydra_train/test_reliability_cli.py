"""Issue 17, command-line part: every failure is one literal line (markup and emoji codes in paths
printed as-is), exit 1, usage errors exit 2 before any data is read; a full disk, a checkpoint
folder that is a file or unusable, a database file that is not SQLite, and ``hydra-model generate``
on a NaN, truncated or tokenizer-less checkpoint. In process, through Typer's runner.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import sys

import pytest
import torch
from typer.testing import CliRunner

from hydra_train.cli import app

from .conftest import TINY_OVERRIDES, VOCAB

runner = CliRunner()


def _args(data, ckpt, *extra: str) -> list[str]:
    args = ["run", "--dataset", str(data), "--vocab_size", str(VOCAB), "--seq_len", "32"]
    args += ["--batch_size", "4", "--max_steps", "4", "--log_every", "1", "--eval_every", "2"]
    args += ["--eval_batches", "1", "--save_every", "2", "--checkpoint_dir", str(ckpt)]
    args += ["--device", "cpu", "--cpu_threads", "1", "--experimental_prefetch_threads", "0"]
    args += ["--model_size", "tiny", "--json"]
    for k, v in TINY_OVERRIDES.items():
        args += ["--model_override", f"{k}={v}"]
    return args + list(extra)


def _one_error_line(output: str) -> str:
    """The single ``error:`` line of ``output``; fails on a traceback or a wrapped message."""
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize(
    ("flag", "value", "names"),
    [
        ("--lr", "inf", "--lr"),
        ("--lr", "nan", "--lr"),
        ("--grad_clip", "nan", "--grad_clip"),
        ("--weight_decay", "-1", "--weight_decay"),
        ("--vocab_size", "0", "--vocab_size"),
        ("--max_skipped_steps", "0", "--max_skipped_steps"),
    ],
)
def test_bad_numeric_flags_are_usage_errors_before_data_loads(tmp_path, flag, value, names):
    # a dataset that does not exist: reading data first would fail with another message and exit 1
    res = runner.invoke(app, _args(tmp_path / "no_such_data", tmp_path / "ck", flag, value))
    assert res.exit_code == 2, res.output
    assert names in _one_error_line(res.output)
    assert not (tmp_path / "ck").exists()


def test_checkpoint_dir_that_is_a_file_with_markup_in_its_name(bin_dataset, tmp_path):
    odd = tmp_path / "ck[red]x[bold]:train:"
    odd.write_text("not a folder")
    res = runner.invoke(app, _args(bin_dataset, odd))
    assert res.exit_code == 1, res.output
    line = _one_error_line(res.output)
    assert str(odd) in line and "is a file" in line  # literal: no markup eaten, no emoji
    assert odd.read_text() == "not a folder"


def test_checkpoint_dir_that_cannot_be_created(bin_dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = runner.invoke(app, _args(bin_dataset, blocker / "sub"))  # a folder below a file
    assert res.exit_code == 1, res.output
    assert "--checkpoint_dir" in _one_error_line(res.output)


def test_full_disk_during_a_save_is_one_line_and_the_run_failed(bin_dataset, tmp_path, monkeypatch):
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if hasattr(f, "fileno"):  # a checkpoint's temporary file (the only saves to a file object)
            f.write(b"partial")
            name = os.readlink(f"/proc/self/fd/{f.fileno()}") if sys.platform == "linux" else None
            raise OSError(errno.ENOSPC, "No space left on device", name)
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    res = runner.invoke(app, _args(bin_dataset, tmp_path))
    assert res.exit_code == 1, res.output
    line = _one_error_line(res.output)
    assert "No space left on device" in line and "free disk space" in line
    with sqlite3.connect(tmp_path / "training.db") as c:
        assert [r[0] for r in c.execute("SELECT status FROM runs")] == ["failed"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_full_disk_in_a_metrics_write_is_one_line_saying_how_to_go_on(bin_dataset, tmp_path, monkeypatch):
    """A disk that fills during an SQLite write reaches Python as sqlite3.OperationalError, not an
    OSError: one line naming the database and how to continue, not a traceback."""
    from hydra_train.metrics_db import TrainingDB

    real_log_step = TrainingDB.log_step

    def full_disk(self, run_id, step, **values):
        if step >= 3:
            raise sqlite3.OperationalError("database or disk is full")
        return real_log_step(self, run_id, step, **values)

    monkeypatch.setattr(TrainingDB, "log_step", full_disk)
    res = runner.invoke(app, _args(bin_dataset, tmp_path))
    assert res.exit_code == 1, res.output
    line = _one_error_line(res.output)
    assert "database or disk is full" in line and "training.db" in line and "free disk space" in line
    assert "continue with: hydra-train run" in line


@pytest.mark.parametrize("content", [b"", b"this is not a database, just text\n"])
def test_db_stats_refuses_a_file_that_is_not_sqlite_and_leaves_it_alone(tmp_path, content):
    from hydra_diag.cli import app as diag_app

    db = tmp_path / "training.db"
    db.write_bytes(content)
    for cli, args in ((app, ["db", "stats"]), (diag_app, ["db", "stats"])):
        res = runner.invoke(cli, [*args, "--checkpoint_dir", str(tmp_path)])
        assert res.exit_code == 1, res.output
        assert str(db) in _one_error_line(res.output)
        assert db.read_bytes() == content
        assert sorted(p.name for p in tmp_path.iterdir()) == ["training.db"]


# -- hydra-model generate ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    import hydra_model

    folder = tmp_path_factory.mktemp("gen")
    model = hydra_model.build_model("hydra", "tiny", vocab_size=32, dim=64, max_seq_len=64)
    torch.save({"model": model.state_dict(), "config": model.config.to_dict()}, folder / "good.pt")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _generate(path, *extra):
    from hydra_model.cli import app as model_app

    args = ["generate", "--checkpoint", str(path), "--prompt", "the cat", "--max-new-tokens", "3"]
    return runner.invoke(model_app, [*args, "--device", "cpu", "--json", *extra])


def test_generate_refuses_a_checkpoint_with_nan_weights(small_checkpoint):
    assert _generate(small_checkpoint / "good.pt").exit_code == 0
    ck = torch.load(small_checkpoint / "good.pt", weights_only=True)
    name = next(k for k, v in ck["model"].items() if v.is_floating_point())
    ck["model"][name] = torch.full_like(ck["model"][name], float("nan"))
    torch.save(ck, small_checkpoint / "nan.pt")
    res = _generate(small_checkpoint / "nan.pt")
    assert res.exit_code == 1, res.output
    assert "non-finite weights" in _one_error_line(res.output)


def test_truncated_checkpoint_does_not_suggest_allow_pickle(small_checkpoint):
    raw = (small_checkpoint / "good.pt").read_bytes()
    (small_checkpoint / "cut.pt").write_bytes(raw[: len(raw) // 2])
    res = _generate(small_checkpoint / "cut.pt")
    assert res.exit_code == 1, res.output
    line = _one_error_line(res.output)
    assert "truncated or corrupt" in line and "allow-pickle" not in line


def test_generate_with_a_garbage_tokenizer_is_one_line(small_checkpoint, tmp_path):
    bad = tmp_path / "tok[bold].json"
    bad.write_text("{ not json")
    res = _generate(small_checkpoint / "good.pt", "--tokenizer", str(bad))
    assert res.exit_code == 1, res.output
    assert str(bad) in _one_error_line(res.output)


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        ("SQLITE_FULL", "free disk space"),
        ("SQLITE_BUSY", "another process holds the database"),
        ("SQLITE_CORRUPT", "hydra-train db rebuild"),
    ],
)
def test_an_sqlite_errors_line_says_what_to_do_for_its_kind(code, hint, capsys):
    """A locked or damaged database is not cured by freeing disk space: the line says what is."""
    import typer

    from hydra_train.cli_errors import run_guarded

    exc = sqlite3.OperationalError("the database failed")
    exc.sqlite_errorname = code  # what sqlite3 sets on errors it raises (Python 3.11+)

    def fails():
        raise exc

    with pytest.raises(typer.Exit) as out:
        run_guarded(fails, debug=False, resume_hint="")
    assert out.value.exit_code == 1
    assert hint in capsys.readouterr().err
