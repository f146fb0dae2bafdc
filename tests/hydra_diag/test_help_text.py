"""Every hydra-diag --help as Typer renders it in rich markup mode: bracketed text survives, a
group's command list has no hard line breaks, arguments have metavars, and options say what they
are and their default."""

from __future__ import annotations

import inspect
import re

import click
import pytest
import typer.main

from hydra_diag.cli import app

from .conftest import invoke


def _commands() -> list[tuple[list[str], click.Command]]:
    """(argv, command) of the root, every group and every command."""
    out = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        out.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


COMMANDS = _commands()
IDS = [" ".join(p) or "hydra-diag" for p, _ in COMMANDS]


def _is_style_tag(inner: str) -> bool:
    """Whether rich reads ``[inner]`` as the markup it is meant to be ([bold], [/], [dim] ...)."""
    from rich.errors import StyleSyntaxError
    from rich.style import Style

    if inner.startswith("/"):
        return True
    try:
        Style.parse(inner)
    except StyleSyntaxError:
        return False
    return True


def _bracketed(cmd: click.Command) -> list[str]:
    """The [...] texts of a command's help and its parameters' help that are meant as text."""
    texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    found = []
    for t in texts:
        for m in re.finditer(r"(\\*)\[([^\[\]]*)\]", t):
            if not _is_style_tag(m.group(2)):
                found.append(f"[{m.group(2)}]")
    return found


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=IDS)
def test_bracketed_help_text_survives_rich_markup(runner, monkeypatch, path, cmd):
    # "Loss without [tokens, vocab] logits." rendered as "Loss without  logits.": rich took the
    # brackets for a style tag (a lower-case word inside is one to rich); \[ escapes them
    monkeypatch.setenv("COLUMNS", "4000")  # no wrapping: each text stays on one line
    res = invoke(runner, [*path, "--help"])
    shown = " ".join(res.stdout.replace("│", " ").split())
    for text in _bracketed(cmd):
        assert " ".join(text.split()) in shown, f"{text} missing from {' '.join(path)} --help"


def _hydra_diag_commands() -> list[tuple[list[str], click.Command]]:
    """The commands (not groups) hydra-diag implements; hydra-train's mounted db commands are
    hydra-train's to format."""
    return [
        (path, cmd)
        for path, cmd in COMMANDS
        if path and not hasattr(cmd, "commands") and cmd.callback.__module__.startswith("hydra_diag")
    ]


OWN = _hydra_diag_commands()


@pytest.mark.parametrize(("path", "cmd"), OWN, ids=[" ".join(p) for p, _ in OWN])
def test_help_paragraphs_have_no_hard_line_breaks(path, cmd):
    # in rich markup mode Typer keeps a docstring's single newlines in the group's command list
    # (and after the first paragraph): at 80 columns the group help showed fragments like "the"
    for paragraph in (cmd.help or "").split("\n\n"):
        assert "\n" not in paragraph, f"{' '.join(path)}: {paragraph!r}"


def test_group_help_at_80_columns_has_no_ragged_fragments(runner, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    res = invoke(runner, ["health", "--help"])
    cells = [ln.strip("│ ").strip() for ln in res.stdout.splitlines()]
    assert "the" not in cells, res.stdout


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=IDS)
def test_usage_lines_name_arguments_in_capitals(runner, path, cmd):
    # race merge and the convert commands showed {files}... / {inputs}...: the parameter's name
    usage = next(ln for ln in invoke(runner, [*path, "--help"]).stdout.splitlines() if "Usage:" in ln)
    assert not re.search(r"[{\[][a-z_]+[}\]]", usage), usage


@pytest.mark.parametrize(
    ("path", "options"),
    [
        (["analyze", "scaling"], ["--batch_size", "--seq_len"]),
        (["eval", "checkpoint"], ["--batch_size", "--seq_len", "--batches"]),
        (["bench", "model"], ["--config", "--mode"]),
        (["bench", "swiglu-backward"], ["--tokens", "--width", "--dtype"]),
        (["bench", "tall-skinny"], ["--m", "--k", "--n"]),
    ],
)
def test_options_say_what_they_are_and_their_default(path, options):
    cmd = dict((tuple(p), c) for p, c in COMMANDS)[tuple(path)]
    helps = {o: p.help for p in cmd.params for o in p.opts}
    for o in options:
        text = helps[o]
        assert "default" in text.lower(), f"{o}: {text!r}"
        # more than the default: a word of what the option is before it
        assert not text.lower().startswith("default"), f"{o}: {text!r}"


def test_listed_defaults_are_the_functions_defaults():
    from hydra_diag.matmul_bench import tall_skinny_bench
    from hydra_kernels.bench_passes import bench_swiglu_backward

    cmds = dict((tuple(p), c) for p, c in COMMANDS)
    for path, fn, pairs in (
        (("bench", "tall-skinny"), tall_skinny_bench, {"--m": "rows_m", "--k": "inner_k", "--n": "outer_n"}),
        (("bench", "swiglu-backward"), bench_swiglu_backward, {"--tokens": "tokens", "--width": "widths"}),
    ):
        helps = {o: p.help for p in cmds[path].params for o in p.opts}
        sig = inspect.signature(fn).parameters
        for opt, arg in pairs.items():
            listed = ", ".join(map(str, sig[arg].default))
            assert f"default {listed})" in helps[opt], (opt, helps[opt], listed)
