"""``hydra-diag race merge`` and the training data: two races can agree on the validation windows
and the window counts while their training streams differ (a pyenv corpus of FORMAT_VERSION 2
against 3: a literal end-of-text string in a training file was one id, it is now text). The race
records ``data.train_digest`` (every training token) and merge refuses runs whose digests differ;
files written before the digest existed merge with a warning, never silently."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hydra_diag.race.data import RaceData, load_race_data
from tests.hydra_diag.conftest import invoke
from tests.hydra_diag.test_race_edges import _doc, _run

T = 16
COMMON = dict(seq_len=T, batch_size=4, seed=1, val_windows=4, vocab_size=256)


def _stream_dataset(folder, train: np.ndarray, val: np.ndarray):
    from hydra_train.shards import write_token_shard

    write_token_shard(folder / "train" / "part0.bin", train)
    write_token_shard(folder / "val" / "part0.bin", val)
    return folder


def _two_builds(tmp_path):
    """The same corpus built twice: the second build reads one training token as three (what
    FORMAT_VERSION 3 did to a literal end-of-text string), so every later training token shifts;
    the stream keeps its length (and window count), and the validation split is the same."""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 200, 40 * T + 1)
    val = rng.integers(0, 200, 8 * T + 1)
    i = 5 * T + 3
    shifted = np.concatenate([train[:i], [250, 251, 252], train[i + 1 :]])[: train.size]
    old = load_race_data(str(_stream_dataset(tmp_path / "old", train, val)), **COMMON)
    new = load_race_data(str(_stream_dataset(tmp_path / "new", shifted, val)), **COMMON)
    return {**old.summary, "name": "corpus"}, {**new.summary, "name": "corpus"}  # one name, as pyenv's


def test_the_race_records_a_digest_of_its_training_stream(tmp_path):
    old, new = _two_builds(tmp_path)
    # what merge keyed the data on before: all equal, though the training tokens differ
    for key in ("val_digest", "train_windows", "vocab_size"):
        assert old[key] == new[key], key
    assert len(old["train_digest"]) == len(new["train_digest"]) == 16
    assert old["train_digest"] != new["train_digest"]
    # the same tokens elsewhere (another folder, another machine) give the same digest
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 200, 40 * T + 1), rng.integers(0, 200, 8 * T + 1)
    again = load_race_data(str(_stream_dataset(tmp_path / "copy", train, val)), **COMMON)
    assert again.summary["train_digest"] == old["train_digest"]


def _shard(tokens: np.ndarray):
    from hydra_train.shards import Shard

    return Shard(path=None, tokens=tokens, max_token_id=None)


def _digest(train) -> str:
    from hydra_train.dataset import TokenDataset

    val = TokenDataset([_shard(np.arange(3 * T + 1) % 7)], T, 256)
    return RaceData(train, val, 256, T, 4, 1, 2).train_digest()


def test_the_digest_covers_exactly_the_training_windows():
    """Equal windows give equal digests whatever the layout (a held-out tail, several shards); a
    token inside a window changes it, a token past the last window does not."""
    from hydra_train.dataset import TokenDataset

    tokens = (np.arange(20 * T + 5) * 7919) % 256
    head, _tail = TokenDataset([_shard(tokens)], T, 256).split_tail(4)
    alone = TokenDataset([_shard(tokens[: 16 * T + 1])], T, 256)
    assert _digest(head) == _digest(alone)
    inside = tokens.copy()
    inside[16 * T] += 1  # the last token of window 15 (shared with window 16, not trained on)
    assert _digest(TokenDataset([_shard(inside)], T, 256).split_tail(4)[0]) != _digest(head)
    past = tokens[: 16 * T + 1].copy()
    assert _digest(TokenDataset([_shard(np.concatenate([past, [1, 2, 3]]))], T, 256)) == _digest(alone)
    two = TokenDataset([_shard(tokens[: 8 * T + 1]), _shard(tokens[8 * T : 16 * T + 1])], T, 256)
    assert two.num_windows == 16 and _digest(two) != _digest(alone)  # other windows: the seam's token
    rows = TokenDataset([_shard(tokens[: 10 * (T + 1)].reshape(10, T + 1))], T, 256)
    changed = rows.shards[0].tokens.copy()
    changed[9, 0] += 1
    assert _digest(rows) != _digest(TokenDataset([_shard(changed)], T, 256))


def _write(tmp_path, name: str, doc: dict):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_merge_refuses_runs_on_other_training_data(runner, tmp_path):
    old, new = _two_builds(tmp_path)
    a = _write(tmp_path, "gpt.json", _doc([_run("gpt", 3.0)], **old))
    b = _write(tmp_path, "hydra.json", _doc([_run("hydra", 2.9)], **new))
    res = invoke(runner, ["race", "merge", a, b])
    assert res.exit_code == 1
    err = " ".join(res.stderr.split())
    assert f"cannot merge {b} with {a}: data.train_digest differs" in err
    assert repr(new["train_digest"]) in err and repr(old["train_digest"]) in err
    assert "race again on one copy of the data" in err
    # the same data on both sides still merges, without a warning
    b = _write(tmp_path, "hydra.json", _doc([_run("hydra", 2.9)], **old))
    res = invoke(runner, ["race", "merge", a, b, "--json", tmp_path / "all.json"])
    assert res.exit_code == 0, res.output
    assert "warning" not in res.stderr
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["data"]["train_digest"] == old["train_digest"]
    assert [m["train_digest"] for m in merged["merged_from"]] == [old["train_digest"]] * 2


def test_files_without_a_digest_merge_with_a_warning(runner, tmp_path):
    """Written before races recorded the digest: two such files still merge, and so does one with
    a new file, each time with a warning naming the unchecked file; the merged document then
    records no digest (a later merge warns again). Digests that are known are still compared,
    also when the first file has none."""
    old, new = _two_builds(tmp_path)
    legacy = {k: v for k, v in old.items() if k != "train_digest"}
    a = _write(tmp_path, "a.json", _doc([_run("gpt", 3.0)], **legacy))
    b = _write(tmp_path, "b.json", _doc([_run("hydra", 2.9)], **legacy))
    res = invoke(runner, ["race", "merge", a, b])
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    assert f"warning: race merge: {a}, {b} record(s) no data.train_digest" in err
    assert "could not be checked" in err
    c = _write(tmp_path, "c.json", _doc([_run("hydra", 2.9)], **old))
    res = invoke(runner, ["race", "merge", c, a, "--json", tmp_path / "ca.json"])
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    assert f"warning: race merge: {a} record(s) no data.train_digest" in err and str(c) not in err
    assert "train_digest" not in json.loads((tmp_path / "ca.json").read_text())["data"]
    d = _write(tmp_path, "d.json", _doc([_run("hydra-mor", 2.8)], **new))
    res = invoke(runner, ["race", "merge", a, c, d])
    assert res.exit_code == 1 and f"cannot merge {d} with {c}: data.train_digest differs" in res.stderr


@pytest.mark.parametrize("digests", [False, True])
def test_pyenv_token_counts_that_differ_are_refused(runner, tmp_path, digests):
    """Old pyenv files (no digest) of the corpus before and after FORMAT_VERSION 3: equal
    validation digest and window counts, other token counts. Refused on data.tokens, which every
    pyenv race has recorded."""
    data = {"name": "pyenv", "val_digest": "v", "train_windows": 100}
    a = _doc([_run("gpt", 3.0)], **data, tokens={"train": 161_000, "val": 9_000})
    b = _doc([_run("hydra", 2.9)], **data, tokens={"train": 161_124, "val": 9_000})
    if digests:
        a["data"]["train_digest"], b["data"]["train_digest"] = "aaaa", "bbbb"
    res = invoke(runner, ["race", "merge", _write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)])
    assert res.exit_code == 1
    err = " ".join(res.stderr.split())
    assert "data.tokens differs ({'train': 161124, 'val': 9000} vs {'train': 161000, 'val': 9000})" in err
    assert "tokenized differently" in err and "FORMAT_VERSION 3" in err
