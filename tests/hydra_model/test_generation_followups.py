"""``hydra-model generate`` with the wrong tokenizer (prompt ids past the model's vocabulary) and
``generate(max_new_tokens=0)``'s ``last_decode_report``."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from hydra_model.cli import app

from .test_generate_cli import word_tokenizer
from .test_generation_review import VOCAB, fresh_model, saved

runner = CliRunner()


def test_prompt_ids_past_the_vocabulary_say_to_pass_the_training_tokenizer(tmp_path):
    _, folder = saved(tmp_path)
    word = f"w{VOCAB + 4}"  # a word of the larger tokenizer whose id the model does not have
    beside = folder / "tokenizer.json"
    other = tmp_path / "other.json"
    for path in (beside, other):
        tok = word_tokenizer(path, VOCAB + 10, eos_at=None)
    assert tok.encode(f"the {word}").ids == [1, VOCAB + 4]  # what the test is about
    args = ["generate", "--checkpoint", str(folder), "--prompt", f"the {word}", "--device", "cpu"]
    for extra, path in (([], beside), (["--tokenizer", str(other)], other)):
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 1, res.output
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        line = res.stderr.strip()
        assert line.startswith("error:") and str(path) in line and str(VOCAB + 4) in line, line
        assert "--tokenizer" in line and "trained with" in line, line


def test_max_new_tokens_zero_reports_this_call():
    model = fresh_model("gpt", 0)
    prompt = torch.tensor([[1, 2, 3]])
    model.generate(prompt, 4)
    before = model.last_decode_report
    assert before.steps > 0  # the previous call decoded: what the test is about
    out = model.generate(prompt, 0)
    assert torch.equal(out, prompt)
    report = model.last_decode_report
    assert report is not before and report.steps == 0, report
    assert report.requested == "auto" and "max_new_tokens=0" in (report.reason or ""), report
