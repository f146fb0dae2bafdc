"""Token ids past the *model's* vocabulary are refused on the host, before a batch reaches the
device: on CUDA the embedding's out-of-range lookup is a device-side assert that poisons the
context (the run dies unreadably and not even the checkpoint callback can save).

The data's own vocabulary (``--vocab_size``, the tokenizer's, meta.json's) was already checked per
batch (test_dataset.py); the model's can be smaller (``--model_override vocab_size=N`` wins over
the data's in build.model_overrides), and then ids between the two passed that check."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.dataset import BatchPlan, TokenDataset, eval_batches
from hydra_train.errors import HydraDataError
from hydra_train.shards import open_shard, write_token_shard

from .conftest import TINY_OVERRIDES


def _raw_shard(path, ids) -> None:
    """A headerless uint16 .bin with its sidecar: its largest id is unknown until a batch reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.asarray(ids, dtype=np.uint16).tobytes())
    path.with_name(path.name + ".json").write_text('{"dtype": "uint16"}')


def test_ids_past_the_models_vocab_are_refused_per_batch(tmp_path):
    _raw_shard(tmp_path / "raw.bin", np.arange(400) % 300)  # ids < 300 = the data's vocabulary
    ds = TokenDataset([open_shard(tmp_path / "raw.bin")], 8, vocab_size=300, name="d")
    ds.check_vocab_size(200)  # the max is not recorded: nothing to refuse yet
    assert ds.vocab_size == 300  # the data's vocabulary (recorded in checkpoints) stays
    plan = BatchPlan(ds, 4, shuffle=False)
    plan.batch(0)  # windows 0-3 hold ids 0..32: inside both vocabularies
    with pytest.raises(HydraDataError) as err:
        plan.batch(6)  # windows 24-27 hold ids 192..224 (window 24: 192..200)
    msg = str(err.value)
    assert "raw.bin: token id 200 (window 24)" in msg
    assert "model's vocabulary [0, 200)" in msg and "the data's is 300" in msg
    assert "--model_override vocab_size" in msg  # what to change
    # validation batches are checked alike, and a held-out tail shares its base's limit
    with pytest.raises(HydraDataError, match=r"raw\.bin: token id 2\d\d .*model's vocabulary"):
        eval_batches(ds, 4, 100)
    head, tail = TokenDataset([open_shard(tmp_path / "raw.bin")], 8, 300).split_tail(10)
    tail.check_vocab_size(200)
    with pytest.raises(HydraDataError, match=r"token id 2\d\d .*model's vocabulary \[0, 200\)"):
        BatchPlan(head, 40, shuffle=False).batch(0)


def test_a_recorded_max_id_past_the_models_vocab_is_refused_at_once(tmp_path):
    shard = open_shard(write_token_shard(tmp_path / "a.bin", np.arange(400) % 300))  # header: max 299
    ds = TokenDataset([shard], 8, vocab_size=300)
    with pytest.raises(HydraDataError) as err:
        ds.check_vocab_size(256)
    msg = str(err.value)
    assert "a.bin: token id 299" in msg and "model's vocabulary [0, 256)" in msg
    assert "re-tokenize" in msg and "--model_override vocab_size" in msg
    # a model vocabulary at least the data's, or above every recorded id, is fine
    ds.check_vocab_size(300)
    ds.check_vocab_size(4096)
    TokenDataset([shard], 8, vocab_size=320).check_vocab_size(300)
    BatchPlan(ds, 4).batch(0)


def test_run_with_a_smaller_model_vocab_is_one_line_error(tmp_path):
    """Unwired, the CPU forward's own check raises a ValueError with a traceback (on CUDA: the
    device-side assert); wired, the data check refuses before the first step."""
    root = tmp_path / "data"
    write_token_shard(root / "train" / "a.bin", np.arange(6000) % 250)
    write_token_shard(root / "val" / "a.bin", np.arange(3000) % 250)
    over = [a for k, v in TINY_OVERRIDES.items() for a in ("--model_override", f"{k}={v}")]
    res = CliRunner().invoke(
        app,
        [
            "run", "--dataset", str(root), "--vocab_size", "256", "--seq_len", "32",
            "--batch_size", "4", "--max_steps", "2", "--model_size", "tiny",
            "--checkpoint_dir", str(tmp_path / "ck"), *over, "--model_override", "vocab_size=128",
        ],
    )  # fmt: skip
    flat = " ".join(res.output.split())
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception  # not a crash
    assert "a.bin: token id 249" in flat and "model's vocabulary [0, 128)" in flat
