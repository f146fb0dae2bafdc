"""Loading a hydra-train checkpoint verifies its checksum, as ``hydra-train run --resume`` does:
``generate`` and ``export-hf`` refuse a file whose weights changed after it was written (they ran
on them silently); a weights-only file without a checksum still loads. And the reason of an
unreadable checkpoint is whole sentences (it was cut mid-word, "... there is a high")."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from hydra_model.cli import app
from hydra_model.persistence import load_model
from hydra_train.checkpoint import FORMAT, save_checkpoint

from .conftest import small_model
from .test_cli_unwritable import one_error_line
from .test_generate_cli import word_tokenizer

runner = CliRunner()


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint as hydra-train writes it (with its checksum), and a tokenizer beside it."""
    model = small_model(seed=2)
    payload = {
        "format": FORMAT,
        "version": 1,
        "step": 5,
        "model": model.state_dict(),
        "config": {"model": model.config.to_dict(), "train": {}},
    }
    path = save_checkpoint(payload, tmp_path / "hydra_small_step5.pt")
    word_tokenizer(tmp_path / "tokenizer.json", model.config.vocab_size, eos_at=None)
    return path


def tamper(path):
    """Change one weight and save the file again with its old checksum (a flipped byte, an edit)."""
    ck = torch.load(path, weights_only=True)
    name = next(k for k, v in ck["model"].items() if v.is_floating_point())
    ck["model"][name] = ck["model"][name].clone()
    ck["model"][name].view(-1)[0] += 0.5
    torch.save(ck, path)


def generate(path):
    args = ["generate", "--checkpoint", str(path), "--prompt", "the cat", "--max-new-tokens", "2"]
    return runner.invoke(app, [*args, "--device", "cpu"])


def test_a_checkpoint_whose_weights_changed_is_refused(checkpoint, tmp_path):
    assert generate(checkpoint).exit_code == 0  # untouched, it loads
    tamper(checkpoint)
    line = one_error_line(generate(checkpoint))
    assert "checksum mismatch" in line and "changed after it was written" in line
    line = one_error_line(runner.invoke(app, ["export-hf", str(checkpoint), str(tmp_path / "hf")]))
    assert "checksum mismatch" in line
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_model(checkpoint)


def test_a_weights_only_file_without_a_checksum_loads(tmp_path):
    model = small_model(seed=2)
    torch.save({"model": model.state_dict(), "config": model.config.to_dict()}, tmp_path / "w.pt")
    loaded = load_model(tmp_path / "w.pt")
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(x).logits, model(x).logits)


def test_the_reason_of_an_unreadable_checkpoint_is_whole(checkpoint):
    raw = checkpoint.read_bytes()
    checkpoint.write_bytes(raw[: len(raw) // 2])
    line = one_error_line(generate(checkpoint))
    reason = re.search(r"truncated or corrupt \((.*)\); copy it again", line)
    assert reason, line
    # torch's message is several sentences: whole ones are kept, up to the first that does not fit
    assert reason[1].endswith("."), reason[1]


def test_a_checkpoint_for_another_device_reads_its_blob_on_the_host(checkpoint, monkeypatch):
    """The file is read on the host whatever the target (its checksum hashed there, its optimizer
    state never sent to the device) and only the model moves; tied weights stay tied. The meta
    device stands in for a GPU here: the same path, no CUDA needed."""
    seen = []
    real_load = torch.load

    def recording_load(f, *args, **kwargs):
        seen.append(kwargs.get("map_location"))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    model = load_model(checkpoint, map_location="meta")
    assert seen == ["cpu"]
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    expected = {n: p.shape for n, p in small_model(seed=2).named_parameters()}
    assert {n: p.shape for n, p in model.named_parameters()} == expected
