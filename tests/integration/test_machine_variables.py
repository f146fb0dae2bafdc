"""Library code takes its output folders as options; it never reads a variable of the machine that
measures it ($OUT of the GPU runner): only the scripts under packages/*/bench may."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READS_OUT = re.compile(r"""environ(?:\.get)?\(?\[?\s*["']OUT["']""")


def test_no_package_source_reads_out():
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted(ROOT.glob("packages/*/src/**/*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if READS_OUT.search(line)
    ]
    assert not offenders, f"library code reads $OUT (make it an option): {offenders}"


def test_the_pattern_finds_a_read():
    assert READS_OUT.search('out = os.environ.get("OUT")') and READS_OUT.search("os.environ['OUT']")
