"""health.py and `hydra-diag health model`: each check passes on a sound model, fails on a planted fault."""

from __future__ import annotations

import math
import types

import torch
from torch import nn

from hydra_diag.health import (
    causality_check,
    component_of,
    forward_backward_check,
    init_statistics,
    model_health_check,
    parameter_breakdown,
    preset_count_check,
)
from hydra_diag.loading import build_model, random_batches

from .conftest import TINY, TINY_SET, VOCAB, invoke, last_error_line, run_json


def _tiny(**kw):
    return build_model("tiny", {**TINY, "vocab_size": VOCAB, **kw})


def test_cli_fresh_model_passes_every_check(runner):
    out = run_json(runner, ["health", "model", *TINY_SET])
    assert out["passed"] is True
    names = {c["name"]: c for c in out["checks"]}
    assert names["initial loss ≈ ln V"]["passed"] is True
    assert abs(out["model"]["initial_ce"] - math.log(VOCAB)) < 0.5
    assert names["eval causality"]["passed"] is True
    # the breakdown covers every parameter exactly once
    assert sum(r["params"] for r in out["parameters"]) == out["model"]["params"]


def test_cli_checkpoint_reports_finiteness_not_init(runner, tiny_run):
    out = run_json(runner, ["health", "model", "--checkpoint", tiny_run.final])
    names = [c["name"] for c in out["checks"]]
    assert "weights finite" in names and "initial loss ≈ ln V" not in names
    assert out["passed"] is True
    assert out["model"]["moe"] is True


def test_cli_refuses_set_with_checkpoint(runner, tiny_run):
    res = invoke(runner, ["health", "model", "--checkpoint", tiny_run.final, "--set", "dim=32"])
    assert res.exit_code == 2  # a usage error: the two flags do not go together
    assert "--set" in last_error_line(res)


def test_preset_count_against_seed_table():
    row = preset_count_check("100M")
    assert row["passed"] is True  # 105.2M against the seed's 104M
    assert preset_count_check("tiny")["passed"] is None  # no seed row: not judged


def test_init_check_flags_a_rescaled_weight_and_nan():
    model = _tiny()
    rows, problems = init_statistics(model, fresh=True)
    assert problems == [] and all(r["ok"] for r in rows)
    with torch.no_grad():
        model.blocks[1].mor.block.attn.w_qkv.weight.mul_(3.0)
        model.norm.weight[0] = float("nan")
    _, problems = init_statistics(model, fresh=True)
    assert any("w_qkv" in p for p in problems)
    assert any("norm.weight holds NaN" in p for p in problems)


def test_forward_backward_failure_fails_the_report():
    model = _tiny()
    with torch.no_grad():
        model.embed.weight[3] = float("inf")
    x, y = random_batches(VOCAB, 2, 16, 1, 0, torch.device("cpu"))[0]
    checks, _ = forward_backward_check(_tiny(), (x, y), torch.device("cpu"))
    assert all(c["passed"] for c in checks)
    x[0, 0] = 3  # the poisoned embedding row is used
    checks, _ = forward_backward_check(model, (x, y), torch.device("cpu"))
    failed = {c["name"] for c in checks if not c["passed"]}
    assert "forward loss finite" in failed


def test_library_report_on_a_fresh_preset():
    report = model_health_check("tiny", dict(TINY, vocab_size=VOCAB), None, "cpu", 2, 16, 0)
    assert report["passed"] is True and report["tool"] == "model_health_check"


class _PeekingModel(nn.Module):
    """Logits at t depend on the last token of the sequence: a causality violation."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        onehot = nn.functional.one_hot(x, self.vocab).float()
        return types.SimpleNamespace(logits=onehot + onehot[:, -1:, :])


def test_causality_check_can_fail():
    good = causality_check(_tiny(), VOCAB, 16, torch.device("cpu"), 0)
    bad = causality_check(_PeekingModel(VOCAB), VOCAB, 16, torch.device("cpu"), 0)
    assert good["passed"] is True and bad["passed"] is False


def test_components_cover_names():
    assert component_of("embed.weight").startswith("embedding")
    assert component_of("blocks.1.router.weight") == "routers"
    assert component_of("blocks.0.mor.block.attn.w_o.weight") == "attention"
    assert component_of("blocks.0.mor.block.norm1.weight") == "norms"
    rows = parameter_breakdown(_tiny(moe_enabled=True))
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-9
