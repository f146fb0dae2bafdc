"""Files on disk that are not what the loaders expect, and writes that fail half-way.

A save into a folder that already holds a save either completes or leaves the earlier one
loadable; a truncated or corrupt file, a Hugging Face folder, a Git LFS pointer or a missing
path is refused with a line naming it (not a library's traceback, nor a hint to allow pickle);
``export-hf`` refuses to write over the checkpoint it reads.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hydra_model.cli import app
from hydra_model.hf_export import ExportError, export_hf
from hydra_model.persistence import load_model

from .conftest import small_model
from .test_generate_cli import word_tokenizer

runner = CliRunner()


def test_a_save_that_fails_half_way_leaves_the_earlier_save_whole(tmp_path, monkeypatch):
    import safetensors.torch

    first = small_model(seed=1)
    first.save_pretrained(tmp_path / "m")
    real_save = safetensors.torch.save_file

    def crash_half_way(tensors, filename, metadata=None):  # a full disk, a killed process
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_half_way)
    with pytest.raises(OSError, match="No space"):
        small_model(seed=2, dim=60).save_pretrained(tmp_path / "m")
    monkeypatch.undo()
    back = load_model(tmp_path / "m")
    assert back.config == first.config
    for name, tensor in first.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]


def test_a_truncated_weights_file_is_named(tmp_path):
    small_model().save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(ValueError, match=r"model\.safetensors is unreadable"):
        load_model(tmp_path / "m")
    res = runner.invoke(app, ["export-hf", str(tmp_path / "m"), str(tmp_path / "hf"), "--no_tokenizer"])
    assert res.exit_code == 1 and "model.safetensors is unreadable" in res.stderr, res.output


def test_a_corrupt_config_json_is_named(tmp_path):
    small_model().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"format": "hydra-model/1", "conf')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model(tmp_path / "m")


def test_a_hugging_face_folder_is_named_as_such(tmp_path):
    small_model().save_pretrained(tmp_path / "m")
    export_hf(tmp_path / "m", tmp_path / "hf")
    with pytest.raises(ValueError, match=r"Hugging Face model folder .*hydra_ccgqa"):
        load_model(tmp_path / "hf")


@pytest.mark.parametrize(
    "content",
    [
        b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 123456\n",
        b"<!DOCTYPE html><html><body>Not Found</body></html>",
    ],
)
def test_a_file_that_is_no_torch_checkpoint_is_not_sent_to_allow_pickle(tmp_path, content):
    (tmp_path / "model.pt").write_bytes(content)
    with pytest.raises(ValueError, match="not a PyTorch checkpoint") as info:
        load_model(tmp_path / "model.pt")
    assert "allow_pickle" not in str(info.value)


def test_a_missing_checkpoint_file_is_not_called_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "typo.pt")


def test_export_into_the_checkpoint_folder_is_refused_and_the_checkpoint_kept(tmp_path):
    model = small_model(seed=3)
    model.save_pretrained(tmp_path / "m")
    word_tokenizer(tmp_path / "m" / "tokenizer.json", 97, eos_at=None)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    with pytest.raises(ExportError, match="checkpoint"):
        export_hf(tmp_path / "m", tmp_path / "m", tokenizer=tmp_path / "m" / "tokenizer.json")
    res = runner.invoke(app, ["export-hf", str(tmp_path / "m"), str(tmp_path / "m" / ".")])
    assert res.exit_code == 1 and "could not export" in res.stderr, res.output
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert torch.equal(load_model(tmp_path / "m").embed.weight, model.embed.weight)


def test_a_re_export_may_ship_the_tokenizer_already_in_the_folder(tmp_path):
    small_model().save_pretrained(tmp_path / "m")
    word_tokenizer(tmp_path / "m" / "tokenizer.json", 97, eos_at=None)
    export_hf(tmp_path / "m", tmp_path / "hf", tokenizer=tmp_path / "m" / "tokenizer.json")
    shipped = tmp_path / "hf" / "tokenizer.json"
    text = shipped.read_bytes()
    result = export_hf(tmp_path / "m", tmp_path / "hf", tokenizer=shipped)
    assert "tokenizer.json" in result.files and shipped.read_bytes() == text


def test_import_hf_names_a_truncated_safetensors_file(tmp_path):
    from .test_hf_llama import tiny_llama

    tiny_llama(tmp_path / "llama")
    weights = tmp_path / "llama" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    res = runner.invoke(app, ["import-hf", str(tmp_path / "llama"), str(tmp_path / "out.pt")])
    assert res.exit_code == 1 and "model.safetensors is unreadable" in res.stderr, res.output
    assert not (tmp_path / "out.pt").exists()


def test_an_export_that_fails_half_way_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
    """export-hf over an earlier export that fails after the weights (a full disk, a kill): the
    earlier export's files are byte for byte what they were, nothing half-written is left beside
    them, and a later export that completes replaces them."""
    import hydra_model.hf_export as hf_export

    small_model(seed=5).save_pretrained(tmp_path / "m")
    export_hf(tmp_path / "m", tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    small_model(seed=6).save_pretrained(tmp_path / "m")  # new weights to export over the old
    real = hf_export._write_json

    def disk_full(path, obj):
        if path.name == "generation_config.json":
            raise OSError(28, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(hf_export, "_write_json", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(tmp_path / "m", tmp_path / "hf")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]  # no staging folder left
    monkeypatch.setattr(hf_export, "_write_json", real)
    export_hf(tmp_path / "m", tmp_path / "hf")
    after = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert after.keys() == before.keys() and after["model.safetensors"] != before["model.safetensors"]
