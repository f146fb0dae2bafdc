"""cli_support's shared pieces: options in both spellings and FIELD=VALUE parsing."""

from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from hydra_kernels.cli_support import AssignmentError, new_app, opt, parse_assignments


def test_parse_assignments_reads_json_else_text():
    got = parse_assignments(["dim=64", " mod_capacity = 0.5", "mor_capacities=[1, 0.5]", "mor_routing=a=b"])
    assert got == {"dim": 64, "mod_capacity": 0.5, "mor_capacities": [1, 0.5], "mor_routing": "a=b"}
    assert parse_assignments(None) == {} and parse_assignments([]) == {}


@pytest.mark.parametrize(
    ("raw", "value"), [("true", True), ("True", True), ("FALSE", False), ("False", False), ("Null", None)]
)
def test_json_literals_in_any_case(raw, value):
    # "False" must not stay the (truthy) string "False"
    assert parse_assignments([f"moe_enabled={raw}"]) == {"moe_enabled": value}


def test_item_without_equals_names_itself():
    with pytest.raises(AssignmentError) as info:
        parse_assignments(["dim=64", "dim128"])
    assert info.value.item == "dim128" and isinstance(info.value, ValueError)


def test_opt_takes_both_spellings_and_lists_kebab_first():
    app = new_app("t")

    @app.command()
    def show(max_steps: Annotated[int, opt("--max_steps", help="Steps.")] = 1) -> None:
        print(max_steps)

    @app.command()
    def other() -> None:  # a second command keeps `show` a subcommand
        pass

    runner = CliRunner()
    assert runner.invoke(app, ["show", "--max_steps", "7"]).stdout.strip() == "7"
    assert runner.invoke(app, ["show", "--max-steps", "8"]).stdout.strip() == "8"
    param = typer.main.get_command(app).commands["show"].params[0]
    assert param.opts == ["--max-steps", "--max_steps"]


def test_emit_json_writes_non_finite_numbers_as_null(capsys):
    """json.dumps wrote NaN/Infinity, which strict parsers (jq, JavaScript's JSON.parse) refuse: a
    loss that went non-finite made every --json output unreadable to a script."""
    import json
    import math
    import random

    from hydra_kernels.cli_support import emit_json

    bad = random.choice([float("nan"), float("inf"), -float("inf")])
    x = random.random()
    emit_json({"loss": bad, "rows": [x, (bad, 2)], "nested": {"a": {"b": bad}}, "n": 3, "s": "nan"})

    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    got = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert got == {"loss": None, "rows": [x, [None, 2]], "nested": {"a": {"b": None}}, "n": 3, "s": "nan"}
    assert math.isfinite(got["rows"][0])
