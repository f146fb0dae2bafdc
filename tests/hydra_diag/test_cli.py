"""cli.py: the app's groups, every command's help, and GPU-only commands on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch
import typer.main

from hydra_diag.cli import app

from .conftest import invoke, one_line_error

GPU_COMMANDS = [
    ["bench", "kernels"],
    ["bench", "backward-kernels"],
    ["bench", "swiglu-backward"],
    ["bench", "model"],
    ["bench", "performance"],
    ["bench", "tall-skinny"],
    ["sweep", "throughput"],
    ["sweep", "vram"],
    ["profile", "kernels"],
    ["profile", "python-overhead"],
]
GROUPS = {
    "bench": {
        "backward-kernels",
        "swiglu-backward",
        "kernels",
        "model",
        "performance",
        "tall-skinny",
        "inference",
    },
    "sweep": {"throughput", "vram", "knobs"},
    "profile": {"kernels", "python-overhead"},
    "health": {"model", "routing"},
    "eval": {"checkpoint", "sanity"},
    "analyze": {"deep-diagnosis", "loss-components", "learning", "scaling"},
    "moe": {"specialization", "watchdog", "weight-balance"},
    "convert": {"jsonl-to-pt", "chat-to-pt", "collect-by-seq"},
    "db": {"stats", "milestones", "ema", "runs", "rebuild", "routing", "evals", "steps", "query"},
}


def test_groups_and_commands():
    root = typer.main.get_command(app)
    for group, commands in GROUPS.items():
        assert set(root.commands[group].commands) == commands, group


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_group_without_arguments_shows_help(runner, group):
    res = invoke(runner, [group])
    assert "Usage" in res.output and res.exit_code in (0, 2)


@pytest.mark.parametrize(
    ("group", "command"), [(g, c) for g, cs in sorted(GROUPS.items()) for c in sorted(cs)]
)
def test_every_command_explains_itself(runner, group, command):
    res = invoke(runner, [group, command, "--help"])
    assert res.exit_code == 0, res.output
    assert len(res.output) > 300


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("args", GPU_COMMANDS, ids=[" ".join(a) for a in GPU_COMMANDS])
def test_gpu_only_commands_need_cuda(runner, args):
    res = invoke(runner, args)
    one_line_error(res, "needs a CUDA GPU", " ".join(args))
    assert res.stdout == ""


def test_tools_command(runner):
    res = invoke(runner, ["tools", "--json"])
    assert res.exit_code == 0 and '"model_health_check"' in res.stdout
