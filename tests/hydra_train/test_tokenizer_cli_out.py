"""``hydra-train tokenizer train``: where ``--out`` writes, and the progress it gives on stderr."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.tokenizer import load_tokenizer

runner = CliRunner()


def _corpus(path, n: int = 40) -> list[str]:
    rng = random.Random()
    texts = ["".join(rng.choice("ab cd\né漢") for _ in range(rng.randint(1, 30))) for _ in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return texts


def test_out_with_a_trailing_slash_is_a_folder_created_for_tokenizer_json(tmp_path):
    _corpus(tmp_path / "d.jsonl")
    folder = tmp_path / "newdir"
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", f"{folder}/"])
    assert res.exit_code == 0, res.output
    assert folder.is_dir(), "a trailing slash names a folder; a file was written in its place"
    assert load_tokenizer(folder / "tokenizer.json").get_vocab_size() >= 256
    assert str(folder / "tokenizer.json") in " ".join(res.stdout.split())


def test_progress_lines_go_to_stderr_and_json_stays_parseable(tmp_path, monkeypatch):
    import hydra_train.cli_tokenizer as cli_tokenizer

    monkeypatch.setattr(cli_tokenizer, "PROGRESS_EVERY_S", 0.0, raising=False)  # a line per document read
    texts = _corpus(tmp_path / "d.jsonl", n=12)
    out = tmp_path / "t.json"
    res = runner.invoke(app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)  # progress never mixes into the JSON on stdout
    assert result["documents"] == len(texts) and result["tokenizer"] == str(out)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    read = [ln for ln in lines if "documents" in ln]
    assert len(read) >= len(texts), res.stderr
    # the counts grow with the reading and the last line reports the whole corpus
    assert f"{len(texts):,} documents" in read[-1] and f"{sum(map(len, texts)):,} characters" in read[-1]


def test_on_a_terminal_the_tokenizers_library_shows_its_own_progress(tmp_path, monkeypatch):
    import hydra_train.cli_tokenizer as cli_tokenizer
    import hydra_train.tokenizer as tokenizer_mod

    seen = []
    real = tokenizer_mod.train_bpe

    def train(texts, vocab_size, show_progress=False):
        seen.append(show_progress)
        return real(texts, vocab_size)

    monkeypatch.setattr(tokenizer_mod, "train_bpe", train)
    monkeypatch.setattr(cli_tokenizer, "stderr_is_terminal", lambda: True, raising=False)
    monkeypatch.setattr(cli_tokenizer, "PROGRESS_EVERY_S", 0.0, raising=False)
    _corpus(tmp_path / "d.jsonl")
    res = runner.invoke(
        app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "t.json")]
    )
    assert res.exit_code == 0 and seen == [True], res.output
    assert "documents" not in res.stderr  # its bars, not lines of ours between them


def test_no_progress_lines_for_quick_work(tmp_path):
    _corpus(tmp_path / "d.jsonl")
    res = runner.invoke(
        app, ["tokenizer", "train", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "t.json"), "--json"]
    )
    assert res.exit_code == 0 and res.stderr.strip() == "", res.stderr
