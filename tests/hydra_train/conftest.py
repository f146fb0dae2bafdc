"""Shared fixtures for the hydra-train tests: a small learnable token dataset and a tiny model config."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hydra_train.config import TrainConfig
from hydra_train.shards import write_token_shard

VOCAB = 320
#: The real "tiny" preset, narrowed so that a step takes milliseconds on a CPU.
TINY_OVERRIDES = {"dim": 64, "max_seq_len": 64}


def learnable_stream(n_tokens: int, seed: int, vocab: int = VOCAB) -> np.ndarray:
    """Tokens from a fixed random bigram table (with noise): a model can lower its loss on it."""
    rng = np.random.default_rng(1234)
    table = rng.integers(1, vocab, size=vocab)
    r = np.random.default_rng(seed)
    out = np.empty(n_tokens, dtype=np.int64)
    out[0] = 1
    noise = r.random(n_tokens) < 0.1
    rand = r.integers(1, vocab, size=n_tokens)
    for i in range(1, n_tokens):
        out[i] = rand[i] if noise[i] else table[out[i - 1]]
    return out


@pytest.fixture(scope="session")
def bin_dataset(tmp_path_factory) -> Path:
    """A folder with train/ and val/ .bin shards of the learnable stream."""
    root = tmp_path_factory.mktemp("data") / "bigram"
    write_token_shard(root / "train" / "part0.bin", learnable_stream(6000, 1))
    write_token_shard(root / "train" / "part1.bin", learnable_stream(5000, 2))
    write_token_shard(root / "val" / "part0.bin", learnable_stream(3000, 3))
    return root


def tiny_config(data: Path, ckpt: Path, **kw) -> TrainConfig:
    base = dict(
        model_size="tiny",
        dataset=str(data),
        vocab_size=VOCAB,
        seq_len=32,
        batch_size=4,
        max_steps=6,
        log_every=2,
        eval_every=3,
        eval_batches=2,
        save_every=3,
        checkpoint_dir=str(ckpt),
        device="cpu",
        experimental_prefetch_threads=0,
        progress=False,
        lr=3e-3,
        warmup_steps=2,
        model_overrides=dict(TINY_OVERRIDES),
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def checkpointed(bin_dataset, tmp_path_factory):
    """A copy of the dataset and a folder with one process's checkpoint of it, for the two-rank
    start tests (batch 4: two ranks of 2 read the same windows and continue it exactly)."""
    root = tmp_path_factory.mktemp("checkpointed")
    data = Path(shutil.copytree(bin_dataset, root / "data"))
    mpatch = pytest.MonkeyPatch()
    mpatch.setenv("HYDRA_CACHE_DIR", str(root / "cache"))
    try:
        from hydra_train.run import run_training

        run_training(tiny_config(data, root / "ck", max_steps=2, save_every=2, cpu_threads=1))
    finally:
        mpatch.undo()
    yield data, root / "ck"
    shutil.rmtree(root, ignore_errors=True)
