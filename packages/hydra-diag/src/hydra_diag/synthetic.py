"""A learnable synthetic token stream: each token follows from the previous one through a fixed
random table, with a share of uniform noise. A model can push its loss from ln V towards the
noise floor, so short runs on it show whether training works, with no files or tokenizer needed.

The floor is known: with noise share ε over V tokens, the next-token entropy is
``H = −(1−ε+ε/V)·ln(1−ε+ε/V) − (V−1)·(ε/V)·ln(ε/V)`` nats (:func:`bigram_entropy`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def bigram_stream(
    n_tokens: int, vocab: int, seed: int = 0, noise: float = 0.1, table_seed: int = 1234
) -> np.ndarray:
    """``n_tokens`` ids in [0, vocab): token t+1 = table[token t], or uniform with probability ``noise``.

    The table depends on ``table_seed`` only, so train and validation streams (different ``seed``)
    follow the same rule."""
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2, got {vocab}")
    table = np.random.default_rng(table_seed).integers(0, vocab, size=vocab)
    rng = np.random.default_rng(seed)
    noisy = rng.random(n_tokens) < noise
    rand = rng.integers(0, vocab, size=n_tokens)
    out = np.empty(n_tokens, dtype=np.int64)
    prev = int(rand[0])
    # a Python loop over a few hundred thousand tokens at most: fast enough, and obviously right
    for i in range(n_tokens):
        prev = int(rand[i]) if (i == 0 or noisy[i]) else int(table[prev])
        out[i] = prev
    return out


def bigram_entropy(vocab: int, noise: float = 0.1) -> float:
    """Next-token entropy (nats) of :func:`bigram_stream`: the loss a perfect model reaches."""
    p_rule = 1 - noise + noise / vocab
    p_other = noise / vocab
    h = -p_rule * math.log(p_rule)
    if p_other > 0:
        h -= (vocab - 1) * p_other * math.log(p_other)
    return h


def write_bigram_dataset(folder: Path, vocab: int, n_train: int, n_val: int, seed: int = 0) -> Path:
    """``folder/train/part0.bin`` and ``folder/val/part0.bin`` as hydra-train shards; returns folder."""
    from hydra_train.shards import write_token_shard

    folder = Path(folder)
    write_token_shard(folder / "train" / "part0.bin", bigram_stream(n_train, vocab, seed=seed + 1))
    write_token_shard(folder / "val" / "part0.bin", bigram_stream(n_val, vocab, seed=seed + 2))
    return folder
