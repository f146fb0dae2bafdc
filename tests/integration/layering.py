"""Checks that imports between the four HYDRA packages only point down the stack.

Two independent checks, both used by ``test_layering.py``:

* static: every ``import``/``from … import`` and every ``importlib.import_module("…")`` or
  ``__import__("…")`` with a literal name, in every source file of a package;
* dynamic: import a package and all its submodules in a fresh interpreter and look at
  ``sys.modules``, which also catches an upward import that happens through a third module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: Bottom of the stack first: a package may import only packages to its left.
LAYERS: tuple[str, ...] = ("hydra_kernels", "hydra_model", "hydra_train", "hydra_diag")
REPO = Path(__file__).resolve().parents[2]


def package_src(pkg: str, repo: Path = REPO) -> Path:
    return repo / "packages" / pkg.replace("_", "-") / "src" / pkg


@dataclass(frozen=True)
class Violation:
    importer: str  # file (static) or package (dynamic)
    line: int
    imported: str

    def __str__(self) -> str:
        where = f"{self.importer}:{self.line}" if self.line else self.importer
        return f"{where} imports {self.imported}, which sits above it"


def _rank(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if name in {"import_module", "__import__"} and isinstance(getattr(arg, "value", None), str):
                found.append((node.lineno, arg.value))
    return found


def static_violations(pkg: str, src: Path | None = None) -> list[Violation]:
    """Upward imports written anywhere in ``pkg``'s source tree."""
    src = src or package_src(pkg)
    own = LAYERS.index(pkg)
    out = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported_names(tree):
            rank = _rank(name)
            if rank is not None and rank > own:
                out.append(Violation(str(path), line, name))
    return out


_PROBE = r"""
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if info.name.rsplit(".", 1)[-1] != "__main__":
        importlib.import_module(info.name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def dynamic_violations(pkg: str, pythonpath: list[str] | None = None) -> list[Violation]:
    """Packages above ``pkg`` that end up in ``sys.modules`` after importing all of ``pkg``."""
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, pkg], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"importing {pkg} failed:\n{proc.stderr[-3000:]}")
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    own = LAYERS.index(pkg)
    return [Violation(pkg, 0, m) for m in loaded if (_rank(m) or -1) > own]
