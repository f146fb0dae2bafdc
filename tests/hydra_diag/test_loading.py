"""loading.py: overrides, checkpoint resolution and loading (three sources), batches."""

from __future__ import annotations

import pytest
import torch

from hydra_diag.loading import (
    batches_for,
    dataset_batches,
    load_model,
    model_from_options,
    parse_overrides,
    resolve_checkpoint,
)
from hydra_diag.output import DiagError

from .conftest import TINY, VOCAB


def test_parse_overrides():
    assert parse_overrides(
        ["dim=64", "moe_enabled=true", "mor_routing=token_choice", "mor_capacities=[1, 0.5]"]
    ) == {"dim": 64, "moe_enabled": True, "mor_routing": "token_choice", "mor_capacities": [1, 0.5]}
    with pytest.raises(DiagError):
        parse_overrides(["dim"])


def test_resolve_and_load_from_each_source(tiny_run, tmp_path):
    assert resolve_checkpoint(tiny_run.folder).name == "hydra_tiny_final.pt"  # newest in the run folder
    from_file = load_model(tiny_run.final)
    assert from_file.step == 16 and from_file.train_config["dataset"] == str(tiny_run.data)
    from_file.model.save_pretrained(tmp_path / "pre")
    from_dir = load_model(tmp_path / "pre")
    sd1, sd2 = from_file.model.state_dict(), from_dir.model.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    with pytest.raises(DiagError, match="does not exist"):
        load_model(tmp_path / "missing.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DiagError, match="no hydra-train checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_a_checkpoint_of_another_shape_is_refused(tiny_run, tmp_path):
    ck = torch.load(tiny_run.final, weights_only=True)
    ck["config"]["model"]["dim"] = 96
    torch.save(ck, tmp_path / "hydra_tiny_step1.pt")
    with pytest.raises(DiagError, match="do not fit"):
        load_model(tmp_path / "hydra_tiny_step1.pt")


def test_batches_from_each_source(tiny_run):
    dev = torch.device("cpu")
    model = model_from_options("tiny", {**TINY, "vocab_size": VOCAB}, None, dev).model
    rnd, desc = batches_for(model, dataset=None, train_config=None, batch_size=2, seq_len=8, n=3, device=dev)
    assert len(rnd) == 3 and desc.startswith("uniform random") and rnd[0][0].shape == (2, 8)
    assert torch.equal(rnd[0][0][:, 1:], rnd[0][1][:, :-1])  # targets are the inputs shifted
    run, desc = batches_for(
        model,
        dataset=None,
        train_config={"dataset": str(tiny_run.data)},
        batch_size=2,
        seq_len=8,
        n=2,
        device=dev,
    )
    assert "shard" in desc and int(run[0][0].max()) < VOCAB
    syn, desc = dataset_batches(
        "synthetic", vocab=50, batch_size=2, seq_len=8, n=2, device=dev, split="train"
    )
    assert desc.startswith("synthetic") and int(syn[0][0].max()) < 50
