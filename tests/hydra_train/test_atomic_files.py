"""atomic_files: a write either lands whole or leaves the old file (and no temporary) behind."""

import os

import pytest

from hydra_train.atomic_files import atomic_write, atomic_write_bytes


def test_writes_whole_file_into_new_folders(tmp_path):
    data = os.urandom(4097)  # fresh bytes each run, not a block multiple
    target = tmp_path / "a" / "b" / "blob.bin"
    atomic_write_bytes(target, data)
    assert target.read_bytes() == data
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old")

    def half_then_fail(f):
        f.write(b"new but partial")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_replaces_an_existing_file(tmp_path):
    target = tmp_path / "x.txt"
    atomic_write_bytes(target, b"first")
    atomic_write(target, lambda f: f.write(b"second"))
    assert target.read_bytes() == b"second"
