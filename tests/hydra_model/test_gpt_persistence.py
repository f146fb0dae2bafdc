"""The dense GPT's persistence, build_model dispatch, CLI and memory estimate: loading picks the
class the file records; HYDRA files without an "arch" still load as HYDRA."""

from __future__ import annotations

import json

import pytest
import torch

import hydra_model
from hydra_model import (
    ARCHITECTURES,
    GPT_PRESETS,
    CCGQAMoDMoRModel,
    GPTModel,
    build_model,
    create_ccgqa_mod_mor_model,
    gpt_config,
    load_model,
)
from hydra_model.persistence import load_checkpoint_file

from .test_gpt import random_model, tokens


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
def test_save_and_load_round_trip(tmp_path, attention):
    model = random_model(attention, use_chunked_ce=attention == "ccgqa").eval()
    ids = tokens(2, 9)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["arch"] == "gpt" and meta["config"] == model.config.to_dict()
    for loaded in (GPTModel.from_pretrained(tmp_path / "m"), load_model(tmp_path / "m")):
        assert type(loaded) is GPTModel and loaded.config == model.config
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(ids).logits, want, atol=0, rtol=0)
        assert loaded.embed.weight.data_ptr() != 0 and loaded.rope.cos.shape[0] == 32
    with pytest.raises(ValueError, match="holds a 'gpt' model"):
        CCGQAMoDMoRModel.from_pretrained(tmp_path / "m")


def test_checkpoint_file_loads_by_arch_and_old_hydra_files_still_load(tmp_path):
    gpt = random_model("gqa").eval()
    ids = tokens(1, 6)
    torch.save(
        {"model": gpt.state_dict(), "config": {"model": gpt.config.to_dict(), "arch": "gpt"}},
        tmp_path / "g.pt",
    )
    loaded = load_checkpoint_file(None, tmp_path / "g.pt")
    assert isinstance(loaded, GPTModel)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, gpt(ids).logits, atol=0, rtol=0)
    # a HYDRA checkpoint from before "arch" existed: no key at all
    torch.manual_seed(0)
    hydra = create_ccgqa_mod_mor_model("tiny", vocab_size=53, dim=64, n_mor_blocks=1).eval()
    torch.save({"model": hydra.state_dict(), "config": {"model": hydra.config.to_dict()}}, tmp_path / "h.pt")
    back = load_model(tmp_path / "h.pt")
    assert type(back) is CCGQAMoDMoRModel
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, hydra(ids).logits, atol=0, rtol=0)


def test_build_model_dispatches_and_names_bad_input():
    assert ARCHITECTURES == ("hydra", "gpt")
    with torch.device("meta"):
        assert isinstance(build_model("gpt", "tiny"), GPTModel)
        assert isinstance(build_model("hydra", "tiny"), CCGQAMoDMoRModel)
        cc = build_model("gpt", "debug", attention="ccgqa", vocab_size=1000)
    assert cc.config.attention == "ccgqa" and cc.config.vocab_size == 1000
    assert hydra_model.build_model is build_model
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        build_model("llama", "tiny")
    with pytest.raises(ValueError, match="unknown model_size"):
        build_model("gpt", "7B")
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['mod_capacity'\]"):
        build_model("gpt", "tiny", mod_capacity=0.5)


def test_memory_estimate_counts_gpt_layers_and_checkpointing():
    from hydra_model import compute_memory_footprint

    cfg = gpt_config("debug")
    with torch.device("meta"):
        model = GPTModel(cfg)
    full = compute_memory_footprint(model, 4, 512)
    assert full == compute_memory_footprint(cfg, 4, 512)
    assert full["parameters"] == model.num_parameters()
    deeper = compute_memory_footprint(cfg.replace(n_layers=12), 4, 512)
    # activations grow linearly with depth: twice the layers, twice the activations
    assert deeper["activation_mb"] == pytest.approx(2 * full["activation_mb"])
    model.enable_gradient_checkpointing(every=1)
    assert compute_memory_footprint(model, 4, 512)["activation_mb"] < full["activation_mb"] / 2


def test_cli_sizes_and_info_take_the_arch():
    from typer.testing import CliRunner

    from hydra_model.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["sizes", "--arch", "gpt", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["model_size"]: r for r in json.loads(res.stdout)["presets"]}
    assert set(rows) == set(GPT_PRESETS)
    with torch.device("meta"):
        want = build_model("gpt", "100M")
    assert rows["100M"]["parameters"] == want.num_parameters() and rows["100M"]["blocks"] == 12
    assert rows["100M"]["flops_per_token_executed"] == want.flops_per_token(2048)
    res = runner.invoke(app, ["info", "--arch", "gpt", "--model_size", "tiny", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["arch"] == "gpt" and info["config"] == gpt_config("tiny").to_dict()
    assert sum(r["parameters"] for r in info["parameter_rows"]) == info["parameters"]
    res = runner.invoke(app, ["sizes", "--arch", "llama"])
    assert res.exit_code == 2 and "choose one of hydra, gpt" in " ".join(res.output.split())
