"""Imports point down the stack only: kernels <- model <- train <- diag."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from .layering import LAYERS, dynamic_violations, package_src, static_violations


@pytest.mark.parametrize("pkg", LAYERS)
def test_no_upward_import_in_source(pkg: str) -> None:
    assert package_src(pkg).is_dir(), f"missing source tree for {pkg}"
    violations = static_violations(pkg)
    assert not violations, "\n".join(map(str, violations))


@pytest.mark.parametrize("pkg", LAYERS[:-1])  # the top package may load anything
def test_no_upward_module_loaded_at_run_time(pkg: str) -> None:
    violations = dynamic_violations(pkg)
    assert not violations, "\n".join(map(str, violations))


def test_static_checker_catches_planted_upward_imports(tmp_path: Path) -> None:
    copy = tmp_path / "hydra_kernels"
    shutil.copytree(package_src("hydra_kernels"), copy)
    assert static_violations("hydra_kernels", copy) == []  # the copy starts clean
    (copy / "planted.py").write_text(
        textwrap.dedent(
            """
            import importlib
            from hydra_model import something
            def later():
                import hydra_diag.cli
                return importlib.import_module("hydra_train.data")
            """
        )
    )
    found = sorted(v.imported for v in static_violations("hydra_kernels", copy))
    assert found == ["hydra_diag.cli", "hydra_model", "hydra_train.data"]


def test_dynamic_checker_catches_indirect_upward_import(tmp_path: Path) -> None:
    # A fake bottom package that imports an innocent third-party module, which in turn imports a
    # package from higher up: no hydra_* name appears in the bottom package's own source.
    (tmp_path / "hydra_kernels").mkdir()
    (tmp_path / "hydra_kernels" / "__init__.py").write_text("import innocent_helper\n")
    (tmp_path / "innocent_helper.py").write_text("import hydra_train\n")
    (tmp_path / "hydra_train").mkdir()
    (tmp_path / "hydra_train" / "__init__.py").write_text("")
    assert static_violations("hydra_kernels", tmp_path / "hydra_kernels") == []
    found = [v.imported for v in dynamic_violations("hydra_kernels", pythonpath=[str(tmp_path)])]
    assert found == ["hydra_train"]
