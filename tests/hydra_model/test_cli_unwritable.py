"""``export-hf`` and ``import-hf`` into a place they cannot write: one ``error:`` line naming the
folder and what to do, exit 1 (it was a 38-line traceback ending in PermissionError or
NotADirectoryError). Root ignores permissions, so a read-only folder is a path under a regular
file (mkdir fails with NotADirectoryError) or a monkeypatched write that raises PermissionError."""

from __future__ import annotations

import errno
import pathlib

import pytest
from typer.testing import CliRunner

from hydra_model.cli import app

from .conftest import small_model

runner = CliRunner()


def one_error_line(res) -> str:
    """The run's stderr, asserted to be one ``error:`` line with exit 1 and no traceback."""
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def saved(tmp_path):
    small_model(seed=3).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_export_under_a_regular_file_names_the_file(saved, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "sub" / "out"
    line = one_error_line(runner.invoke(app, ["export-hf", str(saved), str(out), "--no-tokenizer"]))
    assert str(out) in line and "afile" in line and "not a folder" in line


def test_export_into_a_read_only_folder_names_it_and_leaves_nothing(saved, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    out.mkdir()
    real = pathlib.Path.replace

    def read_only(self, target):  # what a folder without write permission does to a non-root user
        if pathlib.Path(target).parent == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real(self, target)

    monkeypatch.setattr(pathlib.Path, "replace", read_only)
    line = one_error_line(runner.invoke(app, ["export-hf", str(saved), str(out), "--no-tokenizer"]))
    assert str(out) in line and "Permission denied" in line and "write" in line
    assert list(out.iterdir()) == []  # no staging folder left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]


def test_import_under_a_regular_file_names_the_file(tmp_path):
    from .test_hf_llama import tiny_llama

    tiny_llama(tmp_path / "llama")
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "gpt.pt"
    line = one_error_line(runner.invoke(app, ["import-hf", str(tmp_path / "llama"), str(out)]))
    assert str(out.parent) in line and "not a folder" in line


def test_import_into_a_read_only_folder_names_it(tmp_path, monkeypatch):
    from .test_hf_llama import tiny_llama

    tiny_llama(tmp_path / "llama")
    out = tmp_path / "ro" / "gpt.pt"
    out.parent.mkdir()
    real_open = open

    def read_only(file, mode="r", *args, **kwargs):
        if "w" in mode and pathlib.Path(file).parent == out.parent:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    line = one_error_line(runner.invoke(app, ["import-hf", str(tmp_path / "llama"), str(out)]))
    monkeypatch.undo()
    assert str(out) in line and "Permission denied" in line
    assert list(out.parent.iterdir()) == []  # no temporary file left


def test_import_whose_tokenizer_cannot_be_read_does_not_blame_the_output(tmp_path, monkeypatch):
    """A read of the source folder's tokenizer that fails is that file's error, not "cannot write
    the checkpoint ... choose a folder you can write to" (the output is fine)."""
    import shutil

    from .test_hf_llama import tiny_llama

    tiny_llama(tmp_path / "llama")
    source = tmp_path / "llama" / "tokenizer.json"
    if not source.is_file():
        source.write_text("{}")
    real_copy = shutil.copyfile

    def unreadable(src, dst, *args, **kwargs):
        if pathlib.Path(src) == source:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", unreadable)
    args = ["import-hf", str(tmp_path / "llama"), str(tmp_path / "gpt.pt")]
    line = one_error_line(runner.invoke(app, args))
    monkeypatch.undo()
    assert str(source) in line and "cannot write" not in line, line
