"""The hydra-model CLI: sizes, info, generate (in process, through Typer's runner)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hydra_model import SEED_PARAM_COUNTS
from hydra_model.cli import app

from .conftest import small_model

runner = CliRunner()


def test_sizes_json_lists_every_preset():
    res = runner.invoke(app, ["sizes", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["model_size"]: r for r in data["presets"]}
    assert set(rows) == {"tiny", "debug", "100M", "250M", "500M", "1B"}
    for name, count in SEED_PARAM_COUNTS.items():
        assert abs(rows[name]["parameters"] / count - 1) < 0.1
        assert rows[name]["head_dim"] >= 64
        assert rows[name]["flops_per_token_executed"] < rows[name]["flops_per_token_dense"]
    table = runner.invoke(app, ["sizes"])
    assert table.exit_code == 0 and "100M" in table.stdout


def test_info_rows_add_up():
    res = runner.invoke(app, ["info", "--model_size", "100M", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert sum(r["parameters"] for r in data["parameter_rows"]) == data["parameters"]
    assert sum(r["flops"] for r in data["flops_rows"]) == pytest.approx(data["flops_per_token_executed"])
    assert len([r for r in data["flops_rows"] if r["name"].startswith("block")]) == 12  # 12 × 1
    static = json.loads(
        runner.invoke(
            app, ["info", "--model-size", "debug", "--set", "static_routing_mode=true", "--json"]
        ).stdout
    )
    assert static["config"]["static_routing_mode"] is True
    assert runner.invoke(app, ["info", "--model_size", "debug"]).exit_code == 0


def test_info_rejects_bad_overrides():
    res = runner.invoke(app, ["info", "--set", "no_such=1"])
    assert res.exit_code == 2 and "no_such" in " ".join(res.output.split())
    assert runner.invoke(app, ["info", "--set", "oops"]).exit_code == 2


def _tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def test_generate_from_a_saved_model(tmp_path):
    model = small_model()
    model.save_pretrained(tmp_path / "m")
    _tokenizer(tmp_path / "m" / "tokenizer.json")
    res = runner.invoke(
        app,
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "m"),
            "--prompt",
            "the cat sat",
            "--max-new-tokens",
            "5",
            "--json",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["prompt_ids"] == [1, 2, 3]
    import torch

    want = model.generate(torch.tensor([[1, 2, 3]]), 5)[0, 3:].tolist()
    assert data["generated_ids"] == want


def test_generate_from_a_checkpoint_file_with_explicit_tokenizer(tmp_path):
    import torch

    model = small_model()
    torch.save({"model": model.state_dict(), "config": model.config.to_dict()}, tmp_path / "step_10.pt")
    _tokenizer(tmp_path / "tok.json")
    res = runner.invoke(
        app,
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "step_10.pt"),
            "--prompt",
            "a dog",
            "--tokenizer",
            str(tmp_path / "tok.json"),
            "--max_new_tokens",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("a dog")


def test_generate_without_tokenizer_says_so(tmp_path):
    small_model().save_pretrained(tmp_path / "m")
    res = runner.invoke(app, ["generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "hi"])
    text = " ".join(res.output.split())  # rich wraps long lines
    assert res.exit_code == 1
    assert "no tokenizer" in text and "--tokenizer" in text
    res = runner.invoke(
        app,
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "nope"),
            "--prompt",
            "hi",
            "--tokenizer",
            str(tmp_path / "m" / "config.json"),
        ],
    )
    assert res.exit_code == 1 and "does not exist" in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["info", "sizes"])
def test_nonpositive_lengths_are_usage_errors_not_tracebacks(command):
    # --seq-len 0 divided by zero in footprint.py and printed a traceback
    cases = [("--seq-len", "0"), ("--seq-len", "-5")] + (
        [("--batch-size", "0")] if command == "sizes" else []
    )
    for flag, value in cases:
        res = runner.invoke(app, [command, flag, value, "--json"])
        assert res.exit_code == 2, (flag, value, res.output, res.exception)
