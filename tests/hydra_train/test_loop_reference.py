"""The Trainer against an independent plain-PyTorch loop on a tiny CPU model: torch.optim.AdamW
(not fused), explicit ``clip_grad_norm_``, an explicit warmup + cosine schedule, explicit gradient
accumulation. After N steps the weights must agree, and every step's logged lr, loss and
gradient norm must be the ones that step used and saw."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hydra_train.callbacks import CallbackList, TrainerCallback
from hydra_train.config import TrainConfig
from hydra_train.errors import HydraDivergedError
from hydra_train.optim import LRSchedule, build_optimizer
from hydra_train.trainer import Trainer

V, D, B, S = 37, 16, 3, 8


class TinyLM(nn.Module):
    """Embedding, a norm with a bias, a biased linear layer, a biased head: every kind of
    parameter the weight-decay rule tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        h = self.head(torch.tanh(self.mid(self.norm(self.emb(x)))))
        ce = nn.functional.cross_entropy(h.reshape(-1, V), y.reshape(-1), ignore_index=-100)
        return SimpleNamespace(loss=ce, ce_loss=ce, aux_losses={})


class ListLoader:
    """The Prefetcher's interface over a fixed list of batches."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.position = batches, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        return self.batches[self.position - 1]

    def seek(self, position: int) -> None:
        self.position = position

    def close(self) -> None:
        pass


class Rows(TrainerCallback):
    name = "rows"

    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}
        self.step_lr: dict[int, float] = {}

    def on_step_end(self, step, metrics) -> None:
        self.step_lr[step] = metrics.lr

    def on_log(self, step, row) -> None:
        self.rows[step] = row


def reference_factor(step: int, *, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup 1/W .. 1 over steps 0..W-1, then cosine from 1 towards min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / (max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, S), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


class NaNGrad(TrainerCallback):
    """A NaN in one gradient of the given steps (1-based), after their backward."""

    name = "nan_grad"

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_after_backward(self, step, model) -> None:
        if step in self.steps:
            model.mid.weight.grad.view(-1)[0] = float("nan")


def _trainer(model: nn.Module, batches: list, callbacks: list, **kw) -> Trainer:
    """A Trainer on ``model`` over ``batches`` (CPU, fp32, fused AdamW, cosine schedule)."""
    settings = dict(
        batch_size=B, seq_len=S, grad_accum=1, log_every=1, eval_every=10**6, save_every=0,
        lr=3e-2, min_lr_ratio=0.1, lr_schedule="cosine", weight_decay=0.1, device="cpu",
        precision="fp32", max_skipped_steps=10,
    )  # fmt: skip
    cfg = TrainConfig(**{**settings, **kw})
    choice = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    return Trainer(
        model, cfg, optimizer=choice.optimizer, schedule=LRSchedule.from_config(choice.optimizer, cfg),
        loader=ListLoader(list(batches)), val_batches=[], device=torch.device("cpu"),
        callbacks=CallbackList(callbacks), log=lambda m: None,
    )  # fmt: skip


def _run_both(*, steps: int, accum: int, clip: float, warmup: int, skip: frozenset = frozenset()):
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    batches = _batches(steps * accum, seed=1234)
    lr, wd, min_ratio = 3e-2, 0.1, 0.1
    rows = Rows()
    tr = _trainer(
        model, batches, [rows, NaNGrad(set(skip))], grad_accum=accum, max_steps=steps, lr=lr,
        warmup_steps=warmup, min_lr_ratio=min_ratio, grad_clip=clip, weight_decay=wd,
    )  # fmt: skip
    tr.train()

    # the reference: decay on matrices (embedding included), none on biases and norm gains
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    expect = {}
    for s in range(steps):
        lr_s = lr * reference_factor(s, warmup=warmup, max_steps=steps, min_ratio=min_ratio)
        for g in opt.param_groups:
            g["lr"] = lr_s
        opt.zero_grad(set_to_none=True)
        losses = []
        for x, y in batches[s * accum : (s + 1) * accum]:
            loss = ref(x, y).loss
            (loss / accum).backward()
            losses.append(float(loss.detach()))
        if s + 1 in skip:
            ref.mid.weight.grad.view(-1)[0] = float("nan")
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        finite = math.isfinite(norm) and all(math.isfinite(v) for v in losses)
        if finite:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
        expect[s + 1] = dict(lr=lr_s, loss=sum(losses) / accum, grad_norm=norm, finite=finite)
    return tr, model, ref, rows, expect


@pytest.mark.parametrize(("accum", "clip"), [(1, 0.0), (3, 0.05)])
def test_trainer_equals_a_plain_pytorch_loop(accum, clip):
    steps = 7
    tr, model, ref, rows, expect = _run_both(steps=steps, accum=accum, clip=clip, warmup=3)
    for step in range(1, steps + 1):
        row, want = rows.rows[step], expect[step]
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-5), step
        assert row["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert tr.state.tokens_seen == steps * accum * B * S
    if clip > 0:  # the clip did act
        assert any(e["grad_norm"] > clip for e in expect.values())


def test_a_skipped_step_leaves_weights_and_adam_state_as_a_loop_that_skips_it():
    """A NaN gradient at step 3: the step is not applied (Adam's step count included: the bias
    correction of every later step depends on it), the schedule still advances, and the loss EMA
    ignores it; everything after equals a plain loop that skipped that step."""
    steps = 6
    tr, model, ref, rows, expect = _run_both(steps=steps, accum=2, clip=1.0, warmup=2, skip=frozenset({3}))
    assert [rows.rows[s]["finite"] for s in range(1, steps + 1)] == [True, True, False, True, True, True]
    assert tr.skipped_steps() == 1 and rows.rows[steps]["skipped_steps"] == 1
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert all(int(st["step"]) == steps - 1 for st in tr.optimizer.state.values())
    # the short EMA, bias-corrected over the applied steps only
    ema, n = 0.0, 0
    for s in range(1, steps + 1):
        if expect[s]["finite"]:
            ema, n = 0.99 * ema + 0.01 * expect[s]["loss"], n + 1
        assert rows.rows[s]["ema_short"] == pytest.approx(ema / (1 - 0.99**n), rel=1e-5), s


def test_logged_lr_is_the_lr_the_step_used():
    steps = 6
    _, _, _, rows, expect = _run_both(steps=steps, accum=1, clip=1.0, warmup=3)
    logged = [rows.rows[s]["lr"] for s in range(1, steps + 1)]
    assert logged == pytest.approx([expect[s]["lr"] for s in range(1, steps + 1)], rel=1e-9)
    assert [rows.step_lr[s] for s in range(1, steps + 1)] == pytest.approx(logged, rel=1e-9)
    # the first step runs in warmup at 1/warmup of the peak, and its row says so
    assert rows.rows[1]["lr"] == pytest.approx(3e-2 / 3) and rows.rows[1]["lr_phase"] == "warmup"
    assert rows.rows[3]["lr_phase"] == "warmup" and rows.rows[4]["lr_phase"] == "cosine"


def test_a_skip_streak_between_log_points_still_stops_the_run():
    """--max_skipped_steps 2 and 4 non-finite steps in a row (2-5) that end before the next log
    point (step 10): the run must stop, not miss the streak because it ended unseen."""
    torch.manual_seed(0)
    tr = _trainer(
        TinyLM(), _batches(10, seed=5), [NaNGrad({2, 3, 4, 5})], max_steps=10, log_every=10,
        warmup_steps=1, grad_clip=1.0, max_skipped_steps=2,
    )  # fmt: skip
    with pytest.raises(HydraDivergedError, match=r"4 steps in a row \(2-5\)"):
        tr.train()
