"""``hydra-train tokenizer train`` checks its input before its output, and a .jsonl line without the
text field names the --text_column that would read it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.errors import HydraDataError
from hydra_train.shards import read_texts
from hydra_train.shards import write_token_shard as write_ids

runner = CliRunner()


def test_a_missing_input_is_named_before_an_existing_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # the default output of "nowhere/" is ./tokenizer.json
    res = runner.invoke(app, ["tokenizer", "train", "nowhere/"])
    flat = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "nowhere: no such file or folder" in flat and "--force" not in flat


def test_a_folder_without_text_is_named_before_its_tokenizer(tmp_path):
    import numpy as np

    write_ids(tmp_path / "ids.bin", np.arange(10, dtype=np.uint32))
    (tmp_path / "tokenizer.json").write_text("{}")
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path)])
    flat = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "no supported data files (found .bin, .json)" in flat and "--force" not in flat


def test_existing_output_is_still_refused_for_a_good_input(tmp_path):
    (tmp_path / "d.txt").write_text("some text")
    (tmp_path / "tokenizer.json").write_text("{}")
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path)])
    assert res.exit_code == 1 and "exists; pass --force" in " ".join(res.output.split())


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ({"id": 1, "content": "x"}, "(keys: id, content); pass --text_column content"),
        ({"id": 1, "n": 2}, "(keys: id, n); pass --text_column <key> naming the text field"),
        ({"text": 3}, "(its 'text' holds int); choose another --text_column"),
        (["a"], "(this line is a JSON list)"),
    ],
)
def test_jsonl_without_the_text_field_suggests_a_text_column(tmp_path, line, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(line) + "\n")
    with pytest.raises(HydraDataError) as exc:
        read_texts(f)
    assert needle in str(exc.value) and str(exc.value).startswith(f"{f}:1: ")


def test_tokenizer_train_says_which_text_column_to_pass(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    res = runner.invoke(
        app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "t.json")]
    )
    assert res.exit_code == 1 and "pass --text_column body" in " ".join(res.output.split())
