"""``hydra-model`` read at 80 columns: every option of ``generate`` says what it does and its
default, ``sizes`` fits its table uncut, and command descriptions flow as paragraphs (rich keeps a
docstring's single line breaks, so a paragraph broken in the source rendered ragged)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import typer
from typer.testing import CliRunner

from hydra_model.architectures import ARCHITECTURES, presets
from hydra_model.cli import app

runner = CliRunner()
COMMANDS = typer.main.get_command(app).commands


def test_every_generate_option_says_what_it_does_and_its_default():
    missing = []
    for param in COMMANDS["generate"].params:
        name = param.opts[0]
        if not (param.help or "").strip():
            missing.append(f"{name}: no description")
        flag = getattr(param, "is_flag", False)  # a flag is off unless given
        shown = param.default is not None and param.show_default is not False
        if not (param.required or flag or shown or "default" in (param.help or "")):
            missing.append(f"{name}: no default")
    assert not missing, missing
    res = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    top_k = next(line for line in res.output.splitlines() if "--top-k" in line)
    assert "default" in top_k, top_k


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sizes_fits_80_columns(arch):
    res = runner.invoke(app, ["sizes", "--arch", arch], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "…" not in res.output and all(len(line) <= 80 for line in lines), res.output
    for name in presets(arch):  # each preset's row on one line, its memory column included
        row = [line for line in lines if line.startswith(f"│ {name} ")]
        assert len(row) == 1 and "GiB" in row[0], res.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_paragraphs_have_no_hard_line_breaks(name):
    """Rich markup mode keeps a single newline inside a paragraph: each paragraph is one line."""
    paragraphs = inspect.cleandoc(COMMANDS[name].help or "").split("\n\n")
    broken = [p for p in paragraphs if "\n" in p]
    assert not broken, broken


def description(output: str) -> list[list[str]]:
    """The paragraphs of a --help page's description: the lines between the usage and the first
    panel, split at blank lines."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    paragraphs, current = [], []
    for line in lines[start:end]:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            paragraphs.append(current)
            current = []
    return paragraphs + ([current] if current else [])


@pytest.mark.parametrize("name", ["generate", "export-hf", "import-hf"])
def test_descriptions_wrap_only_where_the_line_is_full(name):
    res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0, res.output
    for paragraph in description(res.output):
        for line, after in itertools.pairwise(paragraph):
            # rich breaks a line only when the next word would not fit in the 79 columns it fills
            assert len(line) + 1 + len(after.split()[0]) > 79, f"ragged: {line!r} / {after!r}"
