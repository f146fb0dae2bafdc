"""ARCHITECTURE.md names real files: every repository path it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_path_in_architecture_md_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    paths = {p.rstrip("/") for p in re.findall(r"`((?:packages|tests|docs|tools)/[^`\s]+)`", text)}
    assert len(paths) >= 10  # the page really cites files
    templates = {p for p in paths if "<" in p}  # "ops/<op>.py": a pattern; its folder must exist
    missing = sorted(p for p in paths - templates if not (ROOT / p).exists())
    missing += sorted(p for p in templates if not (ROOT / p).parent.is_dir())
    assert not missing, f"ARCHITECTURE.md cites paths that do not exist: {missing}"
