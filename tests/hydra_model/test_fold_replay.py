"""fold_replay: a new cache's conv-weight fold from a graph replay equals folding op by op, sees
parameters changed in place, folds again when a parameter is replaced, and counts a failed
capture. On the CPU a stand-in graph re-runs the fold into its first outputs' buffers on replay
(what a CUDA graph's replay does to its own buffers); on a GPU the real capture is tested."""

from __future__ import annotations

import os

import pytest
import torch

import hydra_model.fold_replay as fold_replay
from hydra_model.cache import ConvBank
from hydra_model.ccgqa_fold import fold_into_bank, fold_many

from .test_ccgqa_fold import random_modules

FORM = "window_tiles"


class StandInGraph:
    """Replay: run the fold again and write it into the buffers the capture returned."""

    def __init__(self, run, outputs):
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        self.replays += 1
        for (w, b), (new_w, new_b) in zip(self.outputs, self.run(), strict=True):
            tiles = (w.tiles, new_w.tiles) if hasattr(w, "tiles") else (w, new_w)
            tiles[0].copy_(tiles[1])
            if b is not None:
                b.copy_(new_b)


@pytest.fixture
def stand_in(monkeypatch):
    """Graphs replaced by StandInGraph and every group replayable, on the CPU."""
    graphs: list[StandInGraph] = []

    def record(run, device):
        outputs = run()  # the buffers a capture would leave: filled by the first replay
        for w, b in outputs:
            (w.tiles if hasattr(w, "tiles") else w).fill_(float("nan"))
            if b is not None:
                b.fill_(float("nan"))
        graphs.append(StandInGraph(run, outputs))
        return graphs[-1], outputs

    monkeypatch.setattr(fold_replay, "_record", record)
    monkeypatch.setattr(fold_replay, "replayable", lambda group: True)
    fold_replay.reset_replay_status()
    yield graphs
    fold_replay.reset_replay_status()


def bank_fold(mods) -> ConvBank:
    bank = ConvBank(modules=list(mods))
    with torch.no_grad():
        fold_into_bank(bank, mods[0], FORM)
    return bank


def assert_bank_is_the_fold(bank, mods, msg: str) -> None:
    for m, (weight, bias) in zip(mods, fold_many(mods, FORM), strict=True):
        held_weight, held_bias = bank.weights[(m, FORM)]
        assert torch.equal(held_weight.tiles, weight.tiles), msg
        assert torch.equal(held_weight.index, weight.index), msg
        assert torch.equal(held_bias, bias), msg


def test_the_first_fold_is_eager_the_second_captured_then_replayed(stand_in):
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(3, seed)
    for i in range(4):
        assert_bank_is_the_fold(bank_fold(mods), mods, f"seed {seed}, fold {i}")
    status = fold_replay.replay_status()
    assert (status["eager"], status["captured"], status["replayed"]) == (1, 1, 3)
    assert len(stand_in) == 1 and stand_in[0].replays == 3


def test_a_replay_sees_parameters_changed_in_place_and_older_banks_keep_theirs(stand_in):
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(3, seed)
    bank_fold(mods)
    older = bank_fold(mods)  # captured and replayed
    before = [(w.tiles.clone(), b.clone()) for w, b in fold_many(mods, FORM)]
    with torch.no_grad():
        for m in mods:  # in place: the same tensors, as an optimizer step leaves them
            m.conv_ch.weight.mul_(-1.5)
            m.conv_seq.bias.add_(0.25)
    newer = bank_fold(mods)
    assert fold_replay.replay_status()["eager"] == 1  # no new eager fold: the replay saw the change
    assert_bank_is_the_fold(newer, mods, f"seed {seed}")
    for m, (tiles, bias) in zip(mods, before, strict=True):
        held_weight, held_bias = older.weights[(m, FORM)]
        assert torch.equal(held_weight.tiles, tiles), f"seed {seed}: an older bank changed"
        assert torch.equal(held_bias, bias), f"seed {seed}"
        assert not torch.equal(newer.weights[(m, FORM)][0].tiles, tiles), f"seed {seed}"


def test_a_replaced_parameter_folds_eagerly_again(stand_in):
    seed = int.from_bytes(os.urandom(4), "little")
    mods = random_modules(3, seed)
    bank_fold(mods)
    bank_fold(mods)
    with torch.no_grad():  # a new tensor: the graph would read the old one's memory
        mods[1].conv_ch.weight = torch.nn.Parameter(torch.randn_like(mods[1].conv_ch.weight))
    assert_bank_is_the_fold(bank_fold(mods), mods, f"seed {seed}")
    assert fold_replay.replay_status()["eager"] == 2
    assert_bank_is_the_fold(bank_fold(mods), mods, f"seed {seed}")  # captured again, replayed
    assert fold_replay.replay_status()["captured"] == 2


def test_a_failed_capture_is_counted_warned_and_the_fold_stays_right(monkeypatch, stand_in):
    def failing(run, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fold_replay, "_record", failing)
    mods = random_modules(2, 0)
    bank_fold(mods)
    with pytest.warns(RuntimeWarning, match="conv-weight fold failed"):
        assert_bank_is_the_fold(bank_fold(mods), mods, "after the failed capture")
    assert_bank_is_the_fold(bank_fold(mods), mods, "later folds")
    status = fold_replay.replay_status()
    assert status["capture_failed"] == 1 and status["eager"] == 3 and status["replayed"] == 0
    assert "not permitted" in status["last_error"]


def test_nothing_is_replayed_on_the_cpu_or_with_gradients():
    mods = random_modules(2, 1)
    assert not fold_replay.replayable(mods)
    fold_replay.reset_replay_status()
    for _ in range(3):
        assert_bank_is_the_fold(bank_fold(mods), mods, "cpu")
    assert fold_replay.replay_status()["captured"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_on_a_gpu_the_replayed_fold_follows_parameters_updated_by_another_graph():
    seed = int.from_bytes(os.urandom(4), "little")
    mods = [m.cuda() for m in random_modules(3, seed, torch.bfloat16)]
    fold_replay.reset_replay_status()
    for i in range(3):
        assert_bank_is_the_fold(bank_fold(mods), mods, f"seed {seed}, fold {i}")
    # an update replayed from a graph moves no version counter and runs no Python
    update = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        update.capture_begin()
        for m in mods:
            m.conv_ch.weight.mul_(-0.5)
        update.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    update.replay()
    assert_bank_is_the_fold(bank_fold(mods), mods, f"seed {seed}, after the update")
    status = fold_replay.replay_status()
    assert (status["eager"], status["captured"], status["replayed"]) == (1, 1, 3), status
