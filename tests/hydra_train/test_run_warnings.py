"""What a run accepts but says once: a batch bigger than the training data (each batch repeats every
window), a --warmup_steps longer than the run (the learning rate never reaches its peak), and a
small data set's token count written readably (not "0.00M")."""

from __future__ import annotations

import io

from rich.console import Console

from hydra_train.data_sources import load_data
from hydra_train.run import run_training
from hydra_train.shards import write_token_shard

from .conftest import VOCAB, learnable_stream, tiny_config


def _small_data(root):
    write_token_shard(root / "train" / "a.bin", learnable_stream(1452, 1))  # 45 windows of 32 tokens
    write_token_shard(root / "val" / "a.bin", learnable_stream(400, 2))
    return root


def test_small_counts_read_as_numbers(tmp_path):
    from hydra_train.data_sources import token_count

    assert [token_count(n) for n in (0, 1452, 999_999)] == ["0", "1,452", "999,999"]
    assert [token_count(n) for n in (1_000_000, 12_345_678, 2_500_000_000)] == ["1.00M", "12.35M", "2.50B"]
    data = load_data(
        str(_small_data(tmp_path)), seq_len=128, vocab_size=VOCAB, default_vocab=VOCAB, log=print
    )
    assert "1 shard(s), 1,408 tokens," in data.description  # 11 windows of 128: 1,408 tokens used


def test_batch_bigger_than_the_data_is_noted():
    from hydra_train.build import batch_repeats_note

    assert batch_repeats_note(10, 128, 10) is None  # one batch takes every window once
    note = batch_repeats_note(10, 128, 64)
    assert note == (
        "warning: the training data has 10 windows of 128 tokens; a batch of 64 sequences holds each "
        "window 6.4 times on average (use a --batch_size of 10 or less, or more data)"
    )
    # under torchrun a step takes every process's batch
    assert "a batch of 8 sequences (4 per process x 2) holds" in batch_repeats_note(6, 16, 4, 2)
    assert "1.1 times on average" in batch_repeats_note(8, 16, 9)  # not "about 1 times"


def test_warmup_longer_than_the_run_is_noted():
    from hydra_train.build import warmup_note

    assert warmup_note(3, 3) is None and warmup_note(0, 3) is None
    assert warmup_note(10, 3) == (
        "warning: --warmup_steps 10 is more than --max_steps 3: the learning rate never reaches its peak "
        "--lr (the last step's is 30% of it) and never decays; use a --warmup_steps below 3"
    )


def test_a_run_says_each_warning_once(tmp_path):
    buf = io.StringIO()
    cfg = tiny_config(
        _small_data(tmp_path / "data"),
        tmp_path / "ck",
        seq_len=128,
        model_overrides={"dim": 64, "max_seq_len": 128},
        batch_size=64,
        max_steps=2,
        warmup_steps=10,
        eval_every=100,
        save_every=100,
        eval_batches=1,
    )
    run_training(cfg, console=Console(file=buf, width=400))
    out = buf.getvalue()
    assert out.count("warning: the training data has 11 windows of 128 tokens; a batch of 64") == 1
    assert out.count("warning: --warmup_steps 10 is more than --max_steps 2") == 1
    assert "1,408 tokens" in out and "0.00M" not in out
