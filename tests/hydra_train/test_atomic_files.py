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


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX file modes")
def test_a_new_file_gets_the_umasks_mode_and_a_replaced_file_keeps_its_own(tmp_path):
    """A checkpoint or tokenizer written through here was 0600 (mkstemp's mode) whatever the
    umask: a colleague could not read it on a shared machine, and a file chmod'ed by its owner lost
    its mode on the next write. open() is the reference for a new file."""
    import random

    for umask in random.sample([0o022, 0o077, 0o002, 0o027], 2):
        old = os.umask(umask)
        try:
            with open(tmp_path / f"plain_{umask:o}", "wb") as f:  # what a plain write gives
                f.write(b"x")
            atomic_write_bytes(tmp_path / f"atomic_{umask:o}", b"x")
        finally:
            os.umask(old)
        want = os.stat(tmp_path / f"plain_{umask:o}").st_mode & 0o777
        assert os.stat(tmp_path / f"atomic_{umask:o}").st_mode & 0o777 == want == 0o666 & ~umask
    target = tmp_path / "kept.bin"
    atomic_write_bytes(target, b"first")
    mode = random.choice([0o640, 0o604, 0o600, 0o664])
    os.chmod(target, mode)
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second" and os.stat(target).st_mode & 0o777 == mode
