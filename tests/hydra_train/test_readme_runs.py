"""The README's account of the runs table and of text data matches what the code writes."""

from __future__ import annotations

import re
from pathlib import Path

import hydra_train

SRC = Path(hydra_train.__file__).parent
README = SRC.parents[1] / "README.md"


def _statuses_written() -> set[str]:
    """Every run status the package writes: ``status = "x"`` and ``status='x'`` in its sources."""
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        found |= set(re.findall(r"""status\s*=\s*["']([a-z]+)["']""", path.read_text()))
    return found


def test_readme_lists_every_run_status():
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `runs` |"))
    listed = set(re.search(r"status \(([^)]*)\)", row).group(1).replace(" ", "").split(","))
    written = _statuses_written()
    assert {"running", "finished", "killed"} <= written  # the scan sees what settle_dead_runs sets
    assert written <= listed, f"not in the README: {sorted(written - listed)}"


def test_readme_says_which_text_column_to_pass():
    text = " ".join(README.read_text().split())
    assert "the `--text_column <key>` to pass" in text
