"""hydra-diag loads a dense GPT checkpoint or saved folder as a GPTModel (the class it records)."""

from __future__ import annotations

import torch

from hydra_diag.loading import load_model
from hydra_model import GPTModel, build_model


def test_gpt_checkpoint_and_folder_load_as_gpt(tmp_path):
    torch.manual_seed(0)
    model = build_model("gpt", "tiny", vocab_size=61, dim=32, n_layers=2, head_dim=8, mlp_hidden=64).eval()
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    train = {"arch": "gpt", "dataset": "somewhere"}
    payload = {"format": "hydra-train-checkpoint", "step": 3, "model": model.state_dict()}
    payload["config"] = {"model": model.config.to_dict(), "train": train}
    torch.save(payload, tmp_path / "hydra_gpt-tiny_step3.pt")
    model.save_pretrained(tmp_path / "pre")
    for source in (tmp_path / "hydra_gpt-tiny_step3.pt", tmp_path / "pre"):
        loaded = load_model(source).model
        assert type(loaded) is GPTModel and loaded.config == model.config
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(ids).logits, want, atol=0, rtol=0)
