"""router_probe.py: what the hooks recompute must agree with the model's own routing statistics."""

from __future__ import annotations

import pytest
import torch

from hydra_diag.loading import build_model, random_batches
from hydra_diag.router_probe import RouterProbe, restore_buffers, snapshot_buffers

from .conftest import TINY, VOCAB


@pytest.mark.parametrize(
    "extra",
    [
        {"moe_enabled": True},
        {"moe_enabled": True, "moe_balancing": "loss_free", "moe_top_k": 2, "moe_num_experts": 3},
    ],
)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_probe_matches_model_statistics(extra, mode):
    torch.manual_seed(3)
    model = build_model("tiny", {**TINY, "vocab_size": VOCAB, **extra})
    model.train(mode == "train")
    x, _ = random_batches(VOCAB, 3, 29, 1, 5, torch.device("cpu"))[0]  # odd length: ⌈0.75·29⌉ = 22
    saved = snapshot_buffers(model)
    with torch.no_grad(), RouterProbe(model, batch_tokens=x.numel()) as probe:
        model(x)
    stats = model.routing_stats()
    # MoD: in eval mode a token is selected when its router logit is > 0, so the recomputed logits
    # must reproduce the model's selected fraction exactly
    mod = {int(s["layer"]): s for s in stats["mod"]}
    for layer, scores in probe.mod.items():
        summary = scores.summary()
        if mode == "eval":
            assert summary["frac_above_half"] == pytest.approx(float(mod[layer]["selected_frac"]), abs=1e-7)
        assert summary["tokens"] == x.numel()
    # MoE: the probe's expert choices, counted, are the model's utilisation
    for row in stats["moe"]:
        rec = probe.moe[int(row["layer"])]
        counts = rec.counts()
        share = counts / counts.sum()
        assert torch.allclose(share, row["utilization"].float(), atol=1e-6)
        assert rec.chosen[0].shape[1] == extra.get("moe_top_k", 1)
    # the first call of block 0 (dense, first recursion) sees the batch in order
    assert probe.moe[0].in_order[0] is True
    restore_buffers(model, saved)
    for n, b in model.named_buffers():
        assert torch.equal(b, saved[n])


def test_hooks_are_removed():
    model = build_model("tiny", {**TINY, "vocab_size": VOCAB})
    with RouterProbe(model) as probe:
        pass
    assert probe.mod  # the routed middle block was found
    x, _ = random_batches(VOCAB, 1, 8, 1, 0, torch.device("cpu"))[0]
    with torch.no_grad():
        model(x)
    assert all(not s.logits for s in probe.mod.values())
