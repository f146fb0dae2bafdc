"""Every package ships a console script and `python -m <pkg>` that answer --help and --version."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .layering import LAYERS

PACKAGES = [(pkg, pkg.replace("_", "-")) for pkg in LAYERS]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("module", "script"), PACKAGES)
def test_version_matches_package(module: str, script: str) -> None:
    import importlib

    version = importlib.import_module(module).__version__
    exe = shutil.which(script)
    assert exe, f"console script {script} is not installed"
    for cmd in ([exe, "--version"], [sys.executable, "-m", module, "--version"]):
        proc = _run(cmd)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"{script} {version}"


@pytest.mark.parametrize(("module", "script"), PACKAGES)
def test_help_and_no_args(module: str, script: str) -> None:
    exe = shutil.which(script)
    assert exe
    help_out = _run([exe, "--help"])
    assert help_out.returncode == 0, help_out.stderr
    assert "Usage" in help_out.stdout and "--version" in help_out.stdout
    assert _run([sys.executable, "-m", module, "--help"]).stdout == help_out.stdout.replace(exe, script)
    # no arguments shows help rather than doing something (click exits 0 or 2 depending on version)
    bare = _run([exe])
    assert "Usage" in bare.stdout + bare.stderr


@pytest.mark.parametrize("script", [s for _, s in PACKAGES])
def test_unknown_option_is_a_usage_error(script: str) -> None:
    proc = _run([shutil.which(script) or script, "--no-such-option"])
    assert proc.returncode == 2
    assert "No such option" in proc.stderr
