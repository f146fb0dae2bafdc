"""Schedules against hand-computed values; fused AdamW skipping a step on device; the 8-bit fallback."""

from __future__ import annotations

import builtins
import itertools
import math

import pytest
import torch

from hydra_train.optim import LRSchedule, build_optimizer, param_groups


def _opt(lr=1.0):
    p = torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([p], lr=lr)


def test_cosine_schedule_values():
    s = LRSchedule(_opt(2.0), kind="cosine", max_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(111):
        lrs.append(s.get_last_lr()[0])
        s.step()
    assert lrs[0] == pytest.approx(2.0 * 1 / 10) and lrs[9] == pytest.approx(2.0)
    # halfway through the cosine part: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lrs[60] == pytest.approx(2.0 * 0.55)
    assert lrs[110] == pytest.approx(2.0 * 0.1)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(lrs[9:]))
    assert s.phase(5) == "warmup" and s.phase(50) == "cosine"


def test_wsd_schedule_values():
    s = LRSchedule(_opt(1.0), kind="wsd", max_steps=100, warmup_steps=4, min_lr_ratio=0.0, decay_frac=0.2)
    f = s.factor
    assert [f(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(50) == 1.0 and f(79) == 1.0  # stable until the last 20 steps
    assert f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    assert (s.phase(10), s.phase(85)) == ("stable", "decay")


def test_schedule_state_and_tensor_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.5), fused=True)
    s = LRSchedule(opt, kind="cosine", max_steps=20, warmup_steps=2)
    lr_tensor = opt.param_groups[0]["lr"]
    for _ in range(7):
        s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor  # filled in place, not replaced
    s2 = LRSchedule(torch.optim.AdamW([p], lr=0.5), kind="cosine", max_steps=20, warmup_steps=2)
    s2.load_state_dict(s.state_dict())
    assert s2.get_last_lr()[0] == pytest.approx(float(lr_tensor)) == pytest.approx(0.5 * s.factor(7))


def test_weight_decay_only_on_matrices():
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    g = param_groups(m, 0.1)
    assert {p.ndim for p in g[0]["params"]} == {2} and g[0]["weight_decay"] == 0.1
    assert {p.ndim for p in g[1]["params"]} == {1} and g[1]["weight_decay"] == 0.0


def test_fused_adamw_skips_on_found_inf_without_touching_state():
    torch.manual_seed(0)
    m = torch.nn.Linear(5, 3)
    choice = build_optimizer(m, lr=0.1, weight_decay=0.1, betas=(0.9, 0.95))
    opt = choice.optimizer
    assert choice.name == "adamw_fused"
    m(torch.randn(4, 5)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    m(torch.randn(4, 5)).sum().backward()
    opt.found_inf = torch.ones((), dtype=torch.float32)
    opt.step()
    opt.found_inf = None
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state_before[id(p)][k]), k
    opt.step()  # found_inf cleared: this one applies
    assert not torch.equal(m.weight, before["weight"])


def test_8bit_request_without_bitsandbytes_falls_back_with_a_message(monkeypatch):
    real_import = builtins.__import__

    def no_bnb(name, *a, **k):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    msgs = []
    choice = build_optimizer(
        torch.nn.Linear(3, 3), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eight_bit=True, log=msgs.append
    )
    assert choice.name == "adamw_fused" and isinstance(choice.optimizer, torch.optim.AdamW)
    assert len(msgs) == 1 and "--8bit_adam" in msgs[0] and "not installed" in msgs[0]
    assert "fused AdamW" in choice.note


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        LRSchedule(_opt(), kind="linear", max_steps=10, warmup_steps=1)
    assert math.isclose(LRSchedule(_opt(), kind="cosine", max_steps=10, warmup_steps=0).factor(0), 1.0)
