"""Reading a Typer app's rendered --help in tests: the rows of one command's entry in the Commands
panel (where a hard-wrapped docstring showed as ragged fragments at 80 columns)."""

from __future__ import annotations

import re


def command_entry(out: str, command: str) -> list[str]:
    """The rows of ``command``'s entry in the Commands panel of a group's --help output ``out``,
    without the panel's borders."""
    rows = [r for r in out[out.index("Commands") :].splitlines() if r.startswith("│")]
    start = next(i for i, r in enumerate(rows) if r.startswith(f"│ {command} "))
    entry = [rows[start]]
    for r in rows[start + 1 :]:
        if re.match(r"^│ \S", r):  # the next command
            break
        entry.append(r)
    return [r.rstrip(" │") for r in entry]
