"""evaluation.py: `eval checkpoint` reproduces the loss the run logged; `eval sanity` passes on a
learnable setup and fails where learning is impossible."""

from __future__ import annotations

import math

import pytest

from hydra_diag.evaluation import eval_sanity

from .conftest import TINY, VOCAB, invoke, last_error_line, run_json


def test_eval_checkpoint_reproduces_the_logged_validation_loss(runner, tiny_run):
    out = run_json(runner, ["eval", "checkpoint", "--checkpoint", tiny_run.final])
    # the same validation batches, the same CPU fp32 arithmetic: the run's final validation loss
    assert out["val_loss"] == pytest.approx(tiny_run.summary["final_val_loss"], abs=1e-4)
    assert out["recorded_val_loss"] == pytest.approx(out["val_loss"], abs=1e-4)
    assert out["perplexity"] == pytest.approx(math.exp(out["val_loss"]), rel=1e-9)
    assert out["bits_per_token"] == pytest.approx(out["val_loss"] / math.log(2))
    assert out["tokens"] == 2 * 4 * 32  # eval_batches × batch_size × seq_len of the run
    assert out["val_loss"] < out["uniform_loss"]  # the run learned something


def test_eval_checkpoint_from_the_run_folder_picks_the_newest(runner, tiny_run):
    out = run_json(
        runner, ["eval", "checkpoint", "--checkpoint", tiny_run.folder, "--batches", 1, "--routing", "train"]
    )
    assert "hydra_tiny_final.pt" in out["source"] and out["batches"] == 1 and out["routing"] == "train"


def test_eval_checkpoint_errors_are_one_line(runner, tiny_run, tmp_path):
    res = invoke(runner, ["eval", "checkpoint", "--checkpoint", tmp_path / "nope.pt"])
    assert res.exit_code == 1 and "does not exist" in last_error_line(res)
    res = invoke(runner, ["eval", "checkpoint", "--checkpoint", tiny_run.final, "--split", "test"])
    assert res.exit_code == 2 and "--split" in res.stderr  # a usage error, before any loading


def test_eval_sanity_passes_on_a_tiny_model(runner):
    sets = [f"dim={TINY['dim']}", f"n_mor_blocks={TINY['n_mor_blocks']}", f"vocab_size={VOCAB}"]
    args = ["eval", "sanity", "--device", "cpu", "--seq_len", 32, "--overfit_steps", 40, "--run_steps", 16]
    for s in sets:
        args += ["--set", s]
    out = run_json(runner, args)
    assert out["passed"] is True, out["checks"]
    losses = out["overfit_losses"]
    assert len(losses) == 40 and min(losses[-3:]) < 0.5 * losses[0]


def test_eval_sanity_fails_when_nothing_can_learn():
    out = eval_sanity(
        "tiny",
        {**TINY, "vocab_size": VOCAB},
        "cpu",
        seq_len=16,
        overfit_steps=6,
        overfit_lr=0.0,
        run_steps=4,
        run_lr=1e-12,
    )
    assert out["passed"] is False
    failed = {c["name"] for c in out["checks"] if not c["passed"]}
    assert {"overfit one batch", "validation loss decreases"} <= failed


def test_eval_checkpoint_refuses_a_sequence_longer_than_the_model(runner, tiny_run):
    # the model's forward raised ValueError: a traceback instead of one line
    res = invoke(runner, ["eval", "checkpoint", "--checkpoint", tiny_run.final, "--seq_len", 128])
    assert res.exit_code == 1 and "max_seq_len" in last_error_line(res)


def test_mean_cross_entropy_weights_tokens_and_skips_fully_ignored_batches():
    import torch

    from hydra_diag.evaluation import mean_cross_entropy
    from hydra_diag.loading import build_model, random_batches

    torch.manual_seed(0)
    model = build_model("tiny", {**TINY, "vocab_size": VOCAB})
    cpu = torch.device("cpu")
    (x1, y1), (x2, y2), (x3, y3) = random_batches(VOCAB, 2, 16, 3, 0, cpu)
    y1 = y1.clone()
    y1[:, :11] = -100  # few counted tokens in this batch
    y3 = torch.full_like(y3, -100)  # none at all: its mean CE is NaN and must not count
    batches = [(x1, y1), (x2, y2), (x3, y3)]
    loss, tokens = mean_cross_entropy(model, batches, cpu)
    model.eval()
    with torch.no_grad():  # reference: every counted token's CE in fp64, one mean over all of them
        ces = [
            torch.nn.functional.cross_entropy(
                model(x).logits.double().reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum"
            )
            for x, y in batches
        ]
    assert tokens == 2 * 5 + 2 * 16
    assert loss == pytest.approx(float(sum(ces)) / tokens, rel=1e-5)
