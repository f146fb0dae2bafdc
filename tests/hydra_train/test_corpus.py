"""The embedded corpus: what it includes, and a split that depends only on the path."""

from __future__ import annotations

import pytest

from hydra_train.corpus import cache_dir, is_validation_path, load_stdlib_corpus
from hydra_train.errors import HydraDataError


def _fake_stdlib(root):
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/decoder.py": "y = 2\n",
        "test/test_os.py": "import unittest\n",
        "idlelib/idle_test/t.py": "z = 3\n",
        "site-packages/pkg/mod.py": "user code\n",
        "README.txt": "not python\n",
    }
    for i in range(60):
        files[f"lib{i}/m{i}.py"] = f"value = {i}\n" * (i + 1)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return files


def test_selection_and_split(tmp_path):
    files = _fake_stdlib(tmp_path)
    c = load_stdlib_corpus("stdlib", root=tmp_path)
    names = {d.relpath for d in c.train + c.val}
    expected = {r for r in files if r.endswith(".py") and "site-packages" not in r and "test" not in r}
    assert names == expected
    assert all(is_validation_path(d.relpath) for d in c.val)
    assert not any(is_validation_path(d.relpath) for d in c.train)
    full = load_stdlib_corpus("stdlib-full", root=tmp_path)
    assert {d.relpath for d in full.train + full.val} == expected | {
        "test/test_os.py",
        "idlelib/idle_test/t.py",
    }
    assert full.fingerprint != c.fingerprint
    # the fingerprint follows the content
    again = load_stdlib_corpus("stdlib", root=tmp_path)
    assert again.fingerprint == c.fingerprint
    (tmp_path / "os.py").write_text("import sys  # changed\n")
    assert load_stdlib_corpus("stdlib", root=tmp_path).fingerprint != c.fingerprint


def test_split_rule_is_about_five_percent():
    paths = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    frac = sum(map(is_validation_path, paths)) / len(paths)
    assert 0.03 < frac < 0.07


def test_errors_and_cache_dir(tmp_path, monkeypatch):
    with pytest.raises(HydraDataError, match="unknown embedded corpus"):
        load_stdlib_corpus("stdlib-lite", root=tmp_path)
    (tmp_path / "only.py").write_text("x\n")
    with pytest.raises(HydraDataError, match="needs both"):
        load_stdlib_corpus("stdlib", root=tmp_path)
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
