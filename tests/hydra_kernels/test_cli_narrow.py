"""`hydra-kernels status` and `check` at 80 columns (a terminal's default, and what rich assumes
for a log file): every op name must be there whole, never cut to ``ccgqa_co…``."""

import pytest
import torch
from typer.testing import CliRunner

from hydra_kernels import controls
from hydra_kernels.checks import CASES
from hydra_kernels.cli import app

runner = CliRunner()


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _first_cells(output: str) -> set[str]:
    """The first word of every line: the name column of a table."""
    return {line.split()[0] for line in output.splitlines() if line.split()}


def test_status_at_80_columns_names_every_op_whole(no_cuda):
    result = runner.invoke(app, ["status"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout, result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    names = _first_cells(result.stdout)
    for op in {*controls.OPS, *controls.DECODE_OPS}:
        assert op in names, op


def test_check_at_80_columns_tells_the_cases_apart(no_cuda):
    result = runner.invoke(app, ["check", "--quick", "--dtype", "fp32", "--seed", "0"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout, result.stdout
    names = _first_cells(result.stdout)
    for name in {c.name for c in CASES}:  # ccgqa_conv and its zero_context / qk_mean cases
        assert name in names, name
