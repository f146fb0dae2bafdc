"""The race's validation batches are checked against the vocabulary on the host, as hydra-train's
eval_batches are: on CUDA an id past the embedding is a device-side assert that poisons the
context, so every later entrant of the race would fail too, unreadably."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_diag.race.data import load_race_data
from hydra_train.errors import HydraDataError


def _raw_shard(path, ids) -> None:
    """A headerless uint16 .bin with its sidecar: its largest id is not known when it is opened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.asarray(ids, dtype=np.uint16).tobytes())
    path.with_name(path.name + ".json").write_text('{"dtype": "uint16"}')


def test_an_id_past_the_vocabulary_in_validation_is_refused_before_any_entrant(tmp_path):
    root = tmp_path / "data"
    _raw_shard(root / "train" / "a.bin", np.arange(5000) % 256)
    val = np.arange(2000) % 256
    val[700] = 300  # window 43 of 124; val_windows 1000 takes them all
    _raw_shard(root / "val" / "v.bin", val)
    with pytest.raises(
        HydraDataError, match=r"v\.bin: token id 300 \(window \d+\) is outside the vocabulary"
    ):
        load_race_data(str(root), seq_len=16, batch_size=4, seed=0, val_windows=1000, vocab_size=256)
    # the same data inside the vocabulary loads, and its batches are what they were
    val[700] = 5
    _raw_shard(root / "val" / "v.bin", val)
    data = load_race_data(str(root), seq_len=16, batch_size=4, seed=0, val_windows=1000, vocab_size=256)
    batches = data.val_batches()
    assert sum(len(x) for x, _ in batches) == len(data.val_ids)
    x, y = batches[0]
    assert x.dtype == y.dtype == torch.int64
    assert int(x[0, 0]) == int(data.val.window(data.val_ids[0])[0])
