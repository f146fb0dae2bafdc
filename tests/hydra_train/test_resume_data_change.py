"""A resume on data other than the checkpoint's: every checkpoint records a fingerprint of the
window layout (hydra_train/data_fingerprint.py); ``--resume`` refuses a change, naming it, unless
``--allow_data_change``; unchanged data resumes silently and exactly; a checkpoint written before
the fingerprint resumes with a note.

Expected window counts are computed here from the token counts ((tokens - 1) // seq_len per stream
shard, dataset.py's rule), not by the code under test.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from hydra_train.build import load_run_data
from hydra_train.checkpoint import list_checkpoints, save_checkpoint
from hydra_train.cli import app
from hydra_train.cli_errors import run_arguments
from hydra_train.data_fingerprint import data_changes, data_fingerprint
from hydra_train.dataset import TokenDataset
from hydra_train.errors import HydraCheckpointError
from hydra_train.run import run_training
from hydra_train.shards import open_shard, write_token_shard

from .conftest import VOCAB, learnable_stream, tiny_config
from .test_reliability_runs import _folder_bytes
from .test_trainer import CrashAt, Recorder


def _windows(tokens: list[int], seq_len: int) -> int:
    return sum((n - 1) // seq_len for n in tokens)


def _open(folder: Path, seq_len: int, vocab: int = VOCAB) -> tuple[TokenDataset, TokenDataset]:
    def ds(split: str) -> TokenDataset:
        files = sorted((folder / split).glob("*.bin"))
        return TokenDataset([open_shard(p) for p in files], seq_len, vocab, name=split)

    return ds("train"), ds("val")


def _random_data(folder: Path, rng: np.random.Generator, sizes: list[int]) -> list[np.ndarray]:
    streams = [rng.integers(0, VOCAB, size=n) for n in sizes]
    for i, s in enumerate(streams):
        write_token_shard(folder / "train" / f"part{i}.bin", s)
    write_token_shard(folder / "val" / "part0.bin", rng.integers(0, VOCAB, size=int(rng.integers(500, 900))))
    return streams


def test_fingerprint_identifies_the_window_layout(tmp_path):
    rng = np.random.default_rng()
    sizes = [int(n) for n in rng.integers(700, 3000, size=3)]
    seq = int(rng.integers(8, 40))
    streams = _random_data(tmp_path / "a", rng, sizes)
    base = data_fingerprint(*_open(tmp_path / "a", seq))
    assert base["train_windows"] == _windows(sizes, seq) and base["seq_len"] == seq
    assert base["vocab_size"] == VOCAB
    assert len(json.dumps(base)) < 1000  # small: names, counts and short hashes, no token data
    # the same data in another place (a moved or copied folder) is the same data
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert data_fingerprint(*_open(tmp_path / "moved", seq)) == base
    assert data_changes(base, base) == []

    def changed(mutate) -> list[str]:
        shutil.rmtree(tmp_path / "b", ignore_errors=True)
        shutil.copytree(tmp_path / "a", tmp_path / "b")
        s, v = mutate(tmp_path / "b")
        return data_changes(base, data_fingerprint(*_open(tmp_path / "b", s, v)))

    extra = int(rng.integers(700, 3000))

    def add(f):
        write_token_shard(f / "train" / "part9.bin", rng.integers(0, VOCAB, size=extra))
        return seq, VOCAB

    text = "; ".join(changed(add))
    assert f"train windows {base['train_windows']} -> {_windows([*sizes, extra], seq)}" in text
    assert "shards added: train/part9.bin" in text

    def remove(f):
        (f / "train" / "part1.bin").unlink()
        return seq, VOCAB

    assert "shards removed: train/part1.bin" in "; ".join(changed(remove))

    def replace(f):  # same length, other tokens: the window count alone would not notice
        write_token_shard(f / "train" / "part2.bin", streams[2][::-1].copy())
        return seq, VOCAB

    text = "; ".join(changed(replace))
    assert "train/part2.bin" in text and "windows" not in text

    assert f"seq_len {seq} -> {seq + 3}" in "; ".join(changed(lambda f: (seq + 3, VOCAB)))
    assert f"vocab size {VOCAB} -> {VOCAB + 7}" in "; ".join(changed(lambda f: (seq, VOCAB + 7)))


@pytest.fixture
def data(bin_dataset, tmp_path) -> Path:
    """A copy of the shared dataset this test may change."""
    return Path(shutil.copytree(bin_dataset, tmp_path / "data"))


def _resume(data: Path, ckpt: Path, **kw) -> tuple[dict, str, Recorder]:
    out, rec = io.StringIO(), Recorder()
    cfg = tiny_config(data, ckpt, max_steps=5, save_every=3, resume=True, **kw)
    s = run_training(cfg, callbacks=[rec], console=Console(file=out, width=400))
    return s, " ".join(out.getvalue().split()), rec


def _add_shard(data: Path) -> int:
    n = int(np.random.default_rng().integers(2000, 5000))
    write_token_shard(data / "train" / "part2.bin", learnable_stream(n, 7))
    return n


@pytest.mark.parametrize("change", ["shard", "seq_len"])
def test_a_resume_on_changed_data_is_refused_naming_the_change(data, tmp_path, change):
    ckpt = tmp_path / "ck"
    run_training(tiny_config(data, ckpt, max_steps=3, save_every=3))
    kw = {}
    if change == "shard":
        n = _add_shard(data)
        want = [f"train windows {_windows([6000, 5000], 32)} -> {_windows([6000, 5000, n], 32)}"]
        want.append("shards added: train/part2.bin")
    else:
        kw = {"seq_len": 16}
        want = ["--seq_len 16 (checkpoint: 32)"]
    before = _folder_bytes(ckpt)
    with pytest.raises(HydraCheckpointError) as ei:
        _resume(data, ckpt, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and "--allow_data_change" in msg, msg
    for w in want:
        assert w in msg, msg
    assert _folder_bytes(ckpt) == before  # a refusal changes nothing


@pytest.mark.parametrize("change", ["shard", "seq_len"])
def test_allow_data_change_resumes_on_the_new_data_with_a_warning(data, tmp_path, change):
    ckpt = tmp_path / "ck"
    run_training(tiny_config(data, ckpt, max_steps=3, save_every=3))
    kw = {"seq_len": 16} if change == "seq_len" else {}
    if change == "shard":
        _add_shard(data)
    s, log, rec = _resume(data, ckpt, allow_data_change=True, **kw)
    assert s["resumed_from"] is not None and sorted(rec.losses) == [4, 5]
    assert "warning: resume: the data differs from hydra_tiny_final.pt's" in log, log
    assert "batch order is recomputed" in log
    assert ("shards added: train/part2.bin" if change == "shard" else "seq_len 32 -> 16") in log
    # the new checkpoints describe the data they continued on: the next resume needs no flag
    bundle = load_run_data(tiny_config(data, ckpt, **kw), print)
    now = data_fingerprint(bundle.train, bundle.val)
    final = torch.load(ckpt / "hydra_tiny_final.pt", weights_only=True)
    assert final["data"]["fingerprint"] == now and final["step"] == 5


def test_unchanged_data_resumes_silently_and_exactly(bin_dataset, tmp_path):
    full = Recorder()
    run_training(tiny_config(bin_dataset, tmp_path / "a", max_steps=6, save_every=3), callbacks=[full])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(
            tiny_config(bin_dataset, tmp_path / "b", max_steps=6, save_every=3), callbacks=[CrashAt(5)]
        )
    saved = torch.load(tmp_path / "b" / "hydra_tiny_step3.pt", weights_only=True)
    bundle = load_run_data(tiny_config(bin_dataset, tmp_path / "b"), print)
    assert saved["data"]["fingerprint"] == data_fingerprint(bundle.train, bundle.val)
    out, second = io.StringIO(), Recorder()
    cfg = tiny_config(bin_dataset, tmp_path / "b", max_steps=6, save_every=3, resume=True)
    run_training(cfg, callbacks=[second], console=Console(file=out, width=400))
    log = out.getvalue()
    assert "fingerprint" not in log and "data differs" not in log and "could not be checked" not in log
    assert sorted(second.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second.losses[step] == full.losses[step], step  # bitwise
    a = torch.load(tmp_path / "a" / "hydra_tiny_final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "hydra_tiny_final.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_note(data, tmp_path):
    ckpt = tmp_path / "ck"
    run_training(tiny_config(data, ckpt, max_steps=3, save_every=3))
    for p in list_checkpoints(ckpt):  # as an older hydra-train wrote them
        ck = torch.load(p, weights_only=True)
        del ck["data"]["fingerprint"]
        save_checkpoint(ck, p)
    _add_shard(data)  # not checkable: an older checkpoint resumes as it did
    s, log, rec = _resume(data, ckpt)
    assert s["resumed_from"] is not None and sorted(rec.losses) == [4, 5]
    assert "note: hydra_tiny_final.pt holds no data fingerprint" in log and "could not be checked" in log


def test_the_flag_is_in_help_dry_run_and_not_carried_into_the_resume_hint():
    runner = CliRunner()
    res = runner.invoke(app, ["run", "--help"], env={"TERMINAL_WIDTH": "240", "COLUMNS": "240"})
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "--allow_data_change" in text and "batch order" in text
    res = runner.invoke(app, ["run", "--dry_run", "--json", "--allow_data_change", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["allow_data_change"] is True
    # a one-off consent: the hint to continue an interrupted run does not repeat it
    from hydra_train.config import TrainConfig

    assert "--allow_data_change" not in run_arguments(TrainConfig(allow_data_change=True, seed=3))


def test_many_shards_keep_the_fingerprint_small_and_still_tell_a_change(tmp_path, monkeypatch):
    import hydra_train.data_fingerprint as fp_mod

    monkeypatch.setattr(fp_mod, "MAX_LISTED", 2)
    rng = np.random.default_rng()
    sizes = [int(n) for n in rng.integers(700, 3000, size=3)]
    _random_data(tmp_path / "a", rng, sizes)
    base = data_fingerprint(*_open(tmp_path / "a", 16))
    assert base["shards"] is None and base["shard_count"] == 4
    assert data_changes(base, data_fingerprint(*_open(tmp_path / "a", 16))) == []
    write_token_shard(tmp_path / "a" / "train" / "part1.bin", rng.integers(0, VOCAB, size=sizes[1]))
    text = "; ".join(data_changes(base, data_fingerprint(*_open(tmp_path / "a", 16))))
    assert "shards differ" in text


def test_multi_rank_checkpoints_record_and_check_the_fingerprint(data, tmp_path):
    """FSDP on two ranks (gloo): rank 0 writes the payload every rank builds (the same saver as
    DDP and one process), and every rank compares the data on resume (Trainer.resume_from)."""
    from .test_ddp_runs import _train

    common = dict(data=data, ckpt=tmp_path / "ck", batch_size=2, eval_every=100, eval_batches=1, fsdp=True)
    _train(tmp_path, 2, max_steps=2, save_every=2, **common)
    bundle = load_run_data(tiny_config(data, tmp_path), print)
    saved = torch.load(tmp_path / "ck" / "hydra_tiny_final.pt", weights_only=True)["data"]
    assert saved["fingerprint"] == data_fingerprint(bundle.train, bundle.val) and saved["world_size"] == 2
    _add_shard(data)
    _train(tmp_path, 2, max_steps=4, save_every=2, resume=True, allow_data_change=True, **common)
    bundle = load_run_data(tiny_config(data, tmp_path), print)
    final = torch.load(tmp_path / "ck" / "hydra_tiny_final.pt", weights_only=True)
    assert final["step"] == 4 and final["data"]["fingerprint"] == data_fingerprint(bundle.train, bundle.val)


def test_a_copied_text_folder_keeps_its_fingerprint(tmp_path):
    """Packed text files are one shard named by their folder: the dataset folder's own name went
    into every shard name, so a renamed or copied text dataset was "other data" on resume."""
    import random

    from hydra_train.shards import open_shards
    from hydra_train.tokenizer import train_bpe

    rng = random.Random()
    words = ["def", "return", "self", "x", "y", "(", ")", ":", "\n", "    ", "=", "1", "import"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 200))) for _ in range(6)]
    tok = train_bpe(texts, 300)

    def fingerprint(folder: Path, seq: int = 16) -> dict:
        files = sorted(folder.iterdir())
        shards = open_shards(files, tok)
        ds = TokenDataset(shards, seq, 300, name="train")
        train, val = ds.split_tail(1)
        return data_fingerprint(train, val)

    src = tmp_path / "corpusA"
    src.mkdir()
    for i, t in enumerate(texts[:4]):
        (src / f"doc{i}.txt").write_text(t, encoding="utf-8")
    write_token_shard(src / "zz.bin", np.asarray(tok.encode(texts[4]).ids))
    base = fingerprint(src)
    shutil.copytree(src, tmp_path / "renamed")
    assert data_changes(base, fingerprint(tmp_path / "renamed")) == []
    (tmp_path / "renamed" / "doc9.txt").write_text(texts[5], encoding="utf-8")
    text = "; ".join(data_changes(base, fingerprint(tmp_path / "renamed")))
    assert "shards changed length: (packed text files)" in text, text
    assert "added" not in text and "removed" not in text and "zz.bin" not in text
