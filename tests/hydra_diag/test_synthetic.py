"""synthetic.py: the bigram stream follows its rule and its entropy is what the formula says."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from hydra_diag.synthetic import bigram_entropy, bigram_stream, write_bigram_dataset


def test_stream_rule_and_noise_share():
    a = bigram_stream(20000, 13, seed=1, noise=0.2)
    b = bigram_stream(20000, 13, seed=2, noise=0.2)
    assert a.min() >= 0 and a.max() < 13 and not np.array_equal(a, b)
    assert np.array_equal(a, bigram_stream(20000, 13, seed=1, noise=0.2))
    # the most common successor of each token is the table's (same table for both seeds)
    follow = {}
    for s in (a, b):
        for x, y in itertools.pairwise(s):
            follow.setdefault(int(x), Counter())[int(y)] += 1
    rule = {x: c.most_common(1)[0][0] for x, c in follow.items()}
    hits = sum(rule[int(x)] == int(y) for x, y in itertools.pairwise(a)) / (len(a) - 1)
    assert hits == pytest.approx(0.8 + 0.2 / 13, abs=0.01)


def test_entropy_formula_against_an_estimate():
    v, eps = 7, 0.3
    s = bigram_stream(200000, v, seed=0, noise=eps)
    pairs = Counter(zip(s[:-1].tolist(), s[1:].tolist(), strict=True))
    firsts = Counter(s[:-1].tolist())
    h = -sum(n / (len(s) - 1) * math.log(n / firsts[x]) for (x, _), n in pairs.items())
    assert h == pytest.approx(bigram_entropy(v, eps), abs=0.01)
    assert bigram_entropy(v, 0.0) == 0.0


def test_dataset_folder(tmp_path):
    from hydra_train.data_sources import load_data

    write_bigram_dataset(tmp_path, 40, 1000, 300)
    data = load_data(str(tmp_path), seq_len=16, vocab_size=40, default_vocab=40)
    assert data.train.num_windows == (1000 - 1) // 16 and data.val.num_windows == (300 - 1) // 16
