"""Docs stand alone: every .md file a doc, a docstring or a comment cites exists in the repository
(not in a shared folder, a .git directory or another machine)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("packages", "tests", "docs", "tools")
SKIP_PARTS = {".git", "__pycache__", "results", "pretest_logs", ".venv", "node_modules"}
CITED_MD = re.compile(r"(?<![\w/.-])((?:\.?[\w-]+/)*[\w.-]+\.md)\b")
#: (file, citation) pairs known to be wrong in files this branch may not edit; each must still be
#: there (the test fails once it is fixed, so that the exemption goes too)
EXEMPT: set[tuple[str, str]] = set()


def _files() -> list[Path]:
    out = sorted(ROOT.glob("*.md"))
    for top in SOURCES:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in (".md", ".py", ".sh") and not SKIP_PARTS & set(p.parts):
                out.append(p)
    return out


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads as prose: a whole .md file; docstrings and comments of
    Python; comments of shell scripts. String literals (test data) are not citations."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    if path.suffix == ".sh":
        return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith("#")]
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                start = node.body[0].lineno
                out += [(start + k, line) for k, line in enumerate(doc.splitlines())]
    return out


def _resolves(cited: str, path: Path, md_names: set[str]) -> bool:
    if "/" not in cited:
        return cited in md_names
    return any((base / cited).exists() for base in (ROOT, path.parent, ROOT / "packages"))


def find_missing() -> list[tuple[str, int, str]]:
    files = _files()
    md_names = {p.name for p in files if p.suffix == ".md"}
    missing = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line_no, line in _prose(path):
            for m in CITED_MD.finditer(line):
                if not _resolves(m.group(1), path, md_names):
                    missing.append((rel, line_no, m.group(1)))
    return missing


def test_every_cited_md_file_exists():
    missing = find_missing()
    wrong = [m for m in missing if (m[0], m[2]) not in EXEMPT]
    assert not wrong, "cited .md files that are not in the repository: " + "; ".join(
        f"{f}:{n} cites {c}" for f, n, c in wrong
    )
    stale = EXEMPT - {(f, c) for f, _, c in missing}
    assert not stale, f"exemptions no longer needed, remove them: {sorted(stale)}"


def test_the_scan_sees_citations_in_docs_docstrings_and_comments(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('"""See NOWHERE.md."""\n# and GONE.md\nx = "data.md"\n', encoding="utf-8")
    found = {c for _, line in _prose(py) for c in CITED_MD.findall(line)}
    assert found == {"NOWHERE.md", "GONE.md"}  # the string literal is data, not a citation
    assert not _resolves(".git/notes/X.md", py, set()) and _resolves(
        "ARCHITECTURE.md", py, {"ARCHITECTURE.md"}
    )
