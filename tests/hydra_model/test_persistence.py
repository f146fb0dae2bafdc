"""save_pretrained / from_pretrained and hydra-train checkpoint files round-trip exactly."""

from __future__ import annotations

import json

import pytest
import torch

from hydra_model import CCGQAMoDMoRModel
from hydra_model.persistence import load_checkpoint_file

from .conftest import random_tokens, small_model


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("mode", [{}, {"moe_enabled": True, "moe_balancing": "loss_free"}])
def test_save_pretrained_round_trip(tmp_path, mode):
    model = small_model(**mode)
    if mode:
        with torch.no_grad():
            for moe in model.moe_layers():
                moe.balance_bias.normal_()  # persistent state must survive
    model.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["config"]["dim"] == 48 and meta["format"] == "hydra-model/1"
    loaded = CCGQAMoDMoRModel.from_pretrained(tmp_path / "m")
    assert loaded.config == model.config
    for (na, a), (nb, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert na == nb and torch.equal(a, b)
    x = random_tokens(2, 9)
    assert torch.equal(_logits(loaded, x), _logits(model, x))
    assert torch.equal(loaded.rope.cos, model.rope.cos)


def test_checkpoint_file_with_wrapper_prefixes(tmp_path):
    model = small_model()
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    torch.save({"model": state, "config": model.config.to_dict(), "step": 7}, tmp_path / "ck.pt")
    loaded = load_checkpoint_file(CCGQAMoDMoRModel, tmp_path / "ck.pt")
    x = random_tokens(1, 6)
    assert torch.equal(_logits(loaded, x), _logits(model, x))


class _Opaque:
    pass


def test_checkpoint_file_with_pickled_objects_needs_consent(tmp_path):
    model = small_model()
    torch.save(
        {"model": model.state_dict(), "config": model.config.to_dict(), "extra": _Opaque()},
        tmp_path / "ck.pt",
    )
    with pytest.raises(ValueError, match="allow_pickle"):
        load_checkpoint_file(CCGQAMoDMoRModel, tmp_path / "ck.pt")
    loaded = load_checkpoint_file(CCGQAMoDMoRModel, tmp_path / "ck.pt", allow_pickle=True)
    assert loaded.config == model.config


def test_bad_inputs_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        CCGQAMoDMoRModel.from_pretrained(tmp_path)
    torch.save({"weights": {}}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="'model' and 'config'"):
        load_checkpoint_file(CCGQAMoDMoRModel, tmp_path / "x.pt")
    model = small_model()
    other = small_model(dim=96, compression_factor=3.0)
    torch.save({"model": other.state_dict(), "config": model.config.to_dict()}, tmp_path / "mismatch.pt")
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_checkpoint_file(CCGQAMoDMoRModel, tmp_path / "mismatch.pt")
