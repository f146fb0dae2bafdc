"""deep_diagnosis.py: norms per layer against a hand computation, planted dead/exploding layers found."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_diag.deep_diagnosis import deep_diagnosis, find_layer_problems, gradient_groups
from hydra_diag.loading import build_model, random_batches

from .conftest import TINY, VOCAB, assert_png, run_json


def _tiny():
    torch.manual_seed(0)
    return build_model("tiny", {**TINY, "vocab_size": VOCAB})


def test_cli_on_the_run_checkpoint(runner, tiny_run, tmp_path):
    png = tmp_path / "deep.png"
    out = run_json(
        runner, ["analyze", "deep-diagnosis", "--checkpoint", tiny_run.final, "--seq_len", 32, "--plot", png]
    )
    assert_png(png)
    assert out["healthy"] is True
    wheres = {g["where"] for g in out["gradients"]}
    assert {"embedding", "block 0", "block 1", "block 2", "norm"} <= wheres
    blocks = out["activations"]["blocks"]
    assert [b["block"] for b in blocks] == [0, 1, 2]
    assert all(len(b["update_rms"]) == 2 for b in blocks)  # two recursions each
    assert blocks[1]["input_rms"] == pytest.approx(blocks[0]["output_rms"])


def test_gradient_norms_match_a_direct_computation():
    model = _tiny()
    x, y = random_batches(VOCAB, 2, 16, 1, 0, torch.device("cpu"))[0]
    model(x, targets=y).loss.backward()
    rows = {(r["where"], r["component"]): r for r in gradient_groups(model)}
    attn = [p for n, p in model.named_parameters() if n.startswith("blocks.1.") and ".attn." in n]
    want = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in attn))
    assert rows[("block 1", "attention")]["grad_norm"] == pytest.approx(want, rel=1e-6)
    assert rows[("embedding", "embedding (tied LM head)")]["params"] == VOCAB * TINY["dim"]


def test_planted_dead_and_exploding_layers_are_found():
    model = _tiny()
    with torch.no_grad():
        model.blocks[1].mor.block.attn.w_o.weight.zero_()
        model.blocks[1].mor.block.ffn.w_down.weight.zero_()  # block 1's update is exactly zero
        model.blocks[2].mor.block.ffn.w_gate_up.weight.mul_(1e4)  # block 2 blows the stream up
    out = deep_diagnosis(model=model, seq_len=32, device="cpu")
    kinds = {(f["kind"], f["layer"]) for f in out["findings"]}
    assert ("dead_update", "block 1") in kinds
    assert ("exploding_activation", "block 2") in kinds
    assert out["healthy"] is False
    clean = deep_diagnosis(model=_tiny(), seq_len=32, device="cpu")
    assert clean["findings"] == [] and clean["healthy"] is True


def test_rules_on_synthetic_numbers():
    grads = [
        {
            "where": f"block {i}",
            "component": "ffn / experts",
            "params": 10,
            "no_grad_params": 0,
            "grad_norm": g,
        }
        for i, g in enumerate([1.0, 1.2, 0.0, 500.0, float("nan")])
    ]
    grads.append(
        {"where": "block 9", "component": "routers", "params": 4, "no_grad_params": 4, "grad_norm": 0.0}
    )
    found = {(f["kind"], f["layer"]) for f in find_layer_problems(grads, {"blocks": [], "nonfinite": []})}
    assert ("dead_grad", "block 2") in found and ("exploding_grad", "block 3") in found
    assert ("nonfinite_grad", "block 4") in found and ("no_grad", "block 9") in found
    assert not any(layer in ("block 0", "block 1") for _, layer in found)


def test_a_nan_loss_is_reported_in_the_table_not_a_traceback():
    # the CLI renders the JSON-able result, where a NaN loss is None: the header formatted it as a float
    import io

    from rich.console import Console

    from hydra_diag.deep_diagnosis import render_deep_diagnosis
    from hydra_diag.output import jsonable

    model = _tiny()
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    out = jsonable(deep_diagnosis(model=model, seq_len=16, device="cpu"))
    assert out["loss"] is None and out["healthy"] is False
    buf = io.StringIO()
    render_deep_diagnosis(out, Console(file=buf, width=80))
    assert "loss -" in " ".join(buf.getvalue().split())
