"""Each package's declared dependencies match what its source imports.

For every package: the top-level modules its ``src`` imports (``ast`` over every file, the same
reader as the layering test, so ``importlib.import_module("x")`` counts too), against the
distributions its ``pyproject.toml`` declares (``dependencies`` and every optional extra).

* an imported third-party (or sibling HYDRA) module that no declared distribution provides fails;
* a declared distribution whose module is never imported fails (extras included: an extra exists
  for a lazy import behind an install hint, so that import must be there).

Distribution names map to module names by the usual rule (lower case, ``-`` → ``_``) plus the
exceptions in ``MODULE_OF`` below.
"""

from __future__ import annotations

import ast
import re
import sys

import pytest
import tomllib

from tests.integration.layering import LAYERS, REPO, _imported_names, package_src

#: Distributions whose import name is not the distribution name normalised.
MODULE_OF = {
    "pyyaml": "yaml",
    "pillow": "PIL",
    "scikit-learn": "sklearn",
    "websocket-client": "websocket",
    "liger-kernel": "liger_kernel",
    "flash-attn": "flash_attn",
    "beautifulsoup4": "bs4",
}
#: Modules reached through another package's import path: ``torch.utils.tensorboard`` needs the
#: ``tensorboard`` distribution, so importing it counts as using tensorboard.
IMPORTED_VIA = {"torch.utils.tensorboard": "tensorboard"}


def dist_name(requirement: str) -> str:
    """``'triton>=3.0; sys_platform == "linux"'`` → ``triton``; ``Foo_Bar[x]`` → ``foo-bar``."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def module_of(dist: str) -> str:
    return MODULE_OF.get(dist, dist.replace("-", "_"))


def declared(pkg: str) -> dict[str, str]:
    """{distribution: where declared} from the package's pyproject.toml."""
    project = tomllib.loads((package_src(pkg).parents[1] / "pyproject.toml").read_text())["project"]
    out = {dist_name(r): "dependencies" for r in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for r in reqs:
            out.setdefault(dist_name(r), f"extra [{extra}]")
    return out


def imported(pkg: str) -> dict[str, str]:
    """{top-level module: first file:line importing it}, standard library and the package itself left out."""
    src = package_src(pkg)
    out: dict[str, str] = {}
    for f in sorted(src.rglob("*.py")):
        for line, name in _imported_names(ast.parse(f.read_text(), filename=str(f))):
            tops = [name.split(".")[0]]
            tops += [mod for via, mod in IMPORTED_VIA.items() if name == via or name.startswith(via + ".")]
            for top in tops:
                if top in sys.stdlib_module_names or top == pkg or top == "__future__":
                    continue
                out.setdefault(top, f"{f.relative_to(REPO)}:{line}")
    return out


@pytest.mark.parametrize("pkg", LAYERS)
def test_every_import_is_declared(pkg):
    provided = {module_of(d) for d in declared(pkg)}
    missing = {m: where for m, where in imported(pkg).items() if m not in provided}
    assert not missing, f"{pkg} imports modules its pyproject.toml does not declare: {missing}"


@pytest.mark.parametrize("pkg", LAYERS)
def test_every_declared_dependency_is_imported(pkg):
    used = set(imported(pkg))
    unused = {d: how for d, how in declared(pkg).items() if module_of(d) not in used}
    assert not unused, f"{pkg} declares dependencies its source never imports: {unused}"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """The readers see an undeclared import and an unused declaration in a made-up package."""
    import tests.integration.test_dependencies as me

    src = tmp_path / "packages" / "hydra-fake" / "src" / "hydra_fake"
    src.mkdir(parents=True)
    (src / "a.py").write_text("import os\nimport yaml\nfrom torch.utils.tensorboard import SummaryWriter\n")
    (src.parents[1] / "pyproject.toml").write_text(
        '[project]\nname = "hydra-fake"\ndependencies = ["numpy>=1", "PyYAML>=6"]\n'
        '[project.optional-dependencies]\ntb = ["tensorboard>=2"]\n'
    )
    monkeypatch.setattr(me, "package_src", lambda pkg: src)
    monkeypatch.setattr(me, "REPO", tmp_path)
    assert set(me.imported("hydra_fake")) == {"yaml", "torch", "tensorboard"}
    want = {"numpy": "dependencies", "pyyaml": "dependencies", "tensorboard": "extra [tb]"}
    assert me.declared("hydra_fake") == want
    with pytest.raises(AssertionError, match="torch"):
        me.test_every_import_is_declared("hydra_fake")
    with pytest.raises(AssertionError, match="numpy"):
        me.test_every_declared_dependency_is_imported("hydra_fake")


@pytest.mark.parametrize("pkg", LAYERS)
def test_readme_says_what_the_package_installs(pkg):
    """The README's "Installs:" paragraph names every declared distribution and every extra."""
    readme = (package_src(pkg).parents[1] / "README.md").read_text()
    assert "**Installs:**" in readme, f"{pkg}/README.md has no **Installs:** paragraph"
    para = readme.split("**Installs:**", 1)[1].split("\n\n", 1)[0]
    para = " ".join(para.split())
    project = tomllib.loads((package_src(pkg).parents[1] / "pyproject.toml").read_text())["project"]
    missing = [d for d in map(dist_name, project.get("dependencies", [])) if d not in para]
    missing += [f"[{e}]" for e in project.get("optional-dependencies", {}) if f"[{e}]" not in para]
    assert not missing, f"{pkg}/README.md's Installs paragraph does not mention {missing}"
