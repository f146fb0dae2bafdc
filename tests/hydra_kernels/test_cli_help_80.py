"""What a new user of ``hydra-kernels`` meets first, read at 80 columns: the same op names in
``check`` and ``bench``, an out-of-range ``--seed`` named as such, the full check's table with its
result column whole, and --help pages whose descriptions flow as paragraphs, whose option help
survives rich's markup, and whose options state their defaults."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from hydra_kernels import checks, controls
from hydra_kernels.checks import CASES, CheckResult
from hydra_kernels.cli import app
from tests.help_rows import command_entry

runner = CliRunner()
W80 = {"COLUMNS": "80", "TERMINAL_WIDTH": "80"}
COMMANDS = typer.main.get_command(app).commands


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --- one name per op ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_ce"])
def test_check_takes_both_spellings_of_linear_ce(no_cuda, name):
    controls.set_use_triton_kernels(False)  # the references: fast on the CPU
    result = runner.invoke(app, ["check", "--quick", "--op", name, "--dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    assert "linear_cross_entropy" in result.stdout


@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_ce"])
def test_bench_takes_both_spellings_of_linear_ce(no_cuda, name):
    result = runner.invoke(app, ["bench", "--op", name], env={"COLUMNS": "200"})
    # past the --op check: the next thing it says is that there is no GPU
    assert result.exit_code == 1 and "CUDA" in result.stderr, result.output


@pytest.mark.parametrize("command", ["check", "bench"])
def test_op_help_lists_the_valid_names_and_the_alias(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "500"})
    flat = " ".join(result.output.replace("│", " ").split())
    names = [c.name for c in CASES] if command == "check" else ["rms_norm", "linear_cross_entropy"]
    for name in names:
        assert re.search(rf"\b{name}\b", flat), name
    assert "linear_ce" in flat.replace("linear_cross_entropy", "")


# --- --seed ---------------------------------------------------------------------------------------


def test_seed_out_of_range_names_the_option_and_its_range():
    result = runner.invoke(app, ["check", "--quick", "--seed", "99999999999999999999"], env=W80)
    assert result.exit_code == 2
    assert "--seed" in result.stderr and str(checks.MAX_SEED) in result.stderr, result.stderr


def test_run_checks_names_an_out_of_range_seed():
    with pytest.raises(ValueError, match=r"seed -1 is out of range: choose one from 0 to"):
        checks.run_checks(quick=True, ops=["rope"], dtypes=("fp32",), seed=-1)


# --- the full check's table at 80 columns -----------------------------------------------------------


def _fabricated(backends: tuple[str, ...] = ("reference",)) -> list[CheckResult]:
    """A result per case, shape and dtype of the full check (its widest cells), without running it."""
    rows = []
    for case in CASES:
        for shape in case.full_shapes:
            for i, dtype in enumerate(("fp32", "bf16")):
                backend = backends[len(rows) % len(backends)]
                shape_s = "x".join(map(str, shape))
                rows.append(CheckResult(case.name, dtype, shape_s, backend, True, 0.5, f"grad[{i}]", 0))
    return rows


def _run_full_check(monkeypatch, results: list[CheckResult]) -> str:
    monkeypatch.setattr(checks, "run_checks", lambda **kw: results)
    result = runner.invoke(app, ["check"], env=W80)
    assert result.exit_code == (1 if any(not r.passed for r in results) else 0), result.output
    return result.stdout


def _rows(out: str) -> list[str]:
    names = {c.name for c in CASES}
    return [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in names]


def test_full_check_at_80_columns_keeps_the_result_column_whole(no_cuda, monkeypatch):
    results = _fabricated()
    out = _run_full_check(monkeypatch, results)
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out and "result" in out.split(), out
    rows = _rows(out)
    assert len(rows) == len(results), out  # one line each: nothing wrapped onto a second line
    assert all(row.split()[-1] == "pass" for row in rows), out


def test_full_check_with_mixed_backends_and_a_failure_at_80_columns(no_cuda, monkeypatch):
    results = _fabricated(("triton", "reference"))
    error = "RuntimeError: expected [bold] input of shape [3, 5] (see grad[0])"
    results[-1].passed, results[-1].worst_ratio, results[-1].error = False, 123456.0, error
    out = _run_full_check(monkeypatch, results)
    assert max(len(line) for line in out.splitlines()) <= 80, out
    rows = _rows(out)
    assert "…" not in out and len(rows) == len(results), out  # the backend column too, unwrapped
    assert [row.split()[-1] for row in rows] == ["pass"] * (len(results) - 1) + ["FAIL"], out
    assert {"triton", "reference"} <= set(out.split()), out
    # the error whole and verbatim (rich markup would have eaten "[bold]"), under the table
    assert error in " ".join(out.split()), out


@pytest.mark.parametrize(
    ("ratio", "cell"),
    [(None, "-"), (0.0734, "0.073"), (9.9996, "10"), (12.5, "12"), (99999.6, "1e+05"), (123456.0, "1e+05")],
)
def test_a_worst_ratio_takes_at_most_its_headers_width(ratio, cell):
    from hydra_kernels.cli_reports import ratio_cell

    assert ratio_cell(ratio) == cell and len(cell) <= len("worst")


# --- --help at 80 columns -------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_list_is_not_broken_at_source_line_ends(command):
    rows = command_entry(runner.invoke(app, ["--help"], env=W80).output, command)
    # a source line break ended a line early: every line but the entry's last is filled
    assert all(len(r) >= 60 for r in rows[:-1]), "\n".join(rows)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_own_description_is_wrapped_as_paragraphs(command):
    out = runner.invoke(app, [command, "--help"], env=W80).output
    lines = [line.rstrip() for line in out[: out.index("╭")].splitlines()[3:]]
    # inside a paragraph, a line ends short only where the paragraph ends (a blank line follows)
    for line, after in itertools.pairwise(lines):
        if line.strip() and after.strip():
            assert len(line) + 1 + len(after.split()[0]) > 79, f"ragged: {line!r} / {after!r}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_option_help_survives_rich_markup(command):
    out = runner.invoke(app, [command, "--help"], env={"COLUMNS": "500"}).output
    flat = " ".join(out.replace("│", " ").split())
    for param in COMMANDS[command].params:
        if param.help:
            assert " ".join(param.help.split()) in flat, param.help


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_states_its_default(command):
    missing = []
    for param in COMMANDS[command].params:
        flag = getattr(param, "is_flag", False)  # a flag is off unless given
        shown = param.default is not None and param.show_default is not False
        if not (param.required or flag or shown or "default" in (param.help or "")):
            missing.append(param.opts[0])
    assert not missing, missing


def test_the_cli_copies_of_the_checks_names_and_seed_range():
    from hydra_kernels import cli

    # cli keeps its own copies: checks imports every op's module, which --help does without
    assert cli._MAX_SEED == checks.MAX_SEED and list(checks.CHECK_NAMES) == cli._CHECK_NAMES
