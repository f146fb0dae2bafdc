"""Windows, batch order across ranks and epochs, and the data errors raised while batching."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from hydra_train.dataset import BatchPlan, TokenDataset, eval_batches
from hydra_train.errors import HydraDataError
from hydra_train.shards import open_shard, write_token_shard


def _ds(tmp_path, sizes, seq_len, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    shards, arrays = [], []
    for i, n in enumerate(sizes):
        arr = rng.integers(0, vocab, size=n)
        arrays.append(arr)
        shards.append(open_shard(write_token_shard(tmp_path / f"s{i}.bin", arr)))
    return TokenDataset(shards, seq_len, vocab), arrays


def test_windows_are_the_expected_slices(tmp_path):
    ds, arrays = _ds(tmp_path, [103, 37, 64], seq_len=9)
    counts = [(n - 1) // 9 for n in (103, 37, 64)]  # windows never cross a shard boundary
    assert ds.num_windows == sum(counts)
    i = 0
    for arr, c in zip(arrays, counts, strict=True):
        for j in range(c):
            np.testing.assert_array_equal(ds.window(i), arr[j * 9 : j * 9 + 10])
            i += 1


def test_ranks_split_the_single_process_batch(tmp_path):
    ds, _ = _ds(tmp_path, [2000], seq_len=7)
    single = BatchPlan(ds, 6, seed=5)
    ranks = [BatchPlan(ds, 3, seed=5, rank=r, world_size=2) for r in range(2)]
    for k in range(0, 120, 7):  # crosses several epochs (285 windows, 6 per batch)
        ids0, ids1 = ranks[0].window_ids(k), ranks[1].window_ids(k)
        assert ids0 + ids1 == single.window_ids(k)
        x, y = single.batch(k)
        x0, _ = ranks[0].batch(k)
        assert torch.equal(x[:3], x0) and torch.equal(x[:, 1:], y[:, :-1])


def test_each_epoch_is_a_permutation_and_epochs_differ(tmp_path):
    ds, _ = _ds(tmp_path, [1 + 10 * 50], seq_len=10)  # exactly 50 windows
    plan = BatchPlan(ds, 5, seed=1)
    epoch0 = [i for k in range(10) for i in plan.window_ids(k)]
    epoch1 = [i for k in range(10, 20) for i in plan.window_ids(k)]
    assert sorted(epoch0) == list(range(50)) == sorted(epoch1)
    assert epoch0 != epoch1
    assert BatchPlan(ds, 5, seed=1).window_ids(13) == plan.window_ids(13)  # a pure function of k


def test_token_id_outside_vocab_names_the_shard(tmp_path):
    good = write_token_shard(tmp_path / "good.bin", np.arange(50) % 40)
    raw = tmp_path / "bad.bin"
    raw.write_bytes(
        (np.arange(60, dtype=np.uint16) % 40 + np.where(np.arange(60) == 33, 500, 0))
        .astype(np.uint16)
        .tobytes()
    )
    (tmp_path / "bad.bin.json").write_text('{"dtype": "uint16"}')
    ds = TokenDataset([open_shard(good), open_shard(raw)], 4, vocab_size=100)  # max id unknown for bad.bin
    plan = BatchPlan(ds, ds.num_windows, shuffle=False)
    with pytest.raises(
        HydraDataError, match=r"bad\.bin: token id 533 \(window 8\) is outside the vocabulary"
    ):
        plan.batch(0)
    # a shard whose header records a too-large id is refused when the dataset is opened
    with pytest.raises(HydraDataError, match=r"good\.bin: token id 39 >= vocab size 30"):
        TokenDataset([open_shard(good)], 4, vocab_size=30)


def test_empty_and_too_long_data(tmp_path):
    with pytest.raises(HydraDataError, match="empty dataset"):
        TokenDataset([open_shard(write_token_shard(tmp_path / "e.bin", np.arange(5)))], 16, 100)
    with pytest.raises(HydraDataError, match="no shards"):
        TokenDataset([], 16, 100)
    torch.save({"input_ids": torch.randint(0, 50, (4, 130))}, tmp_path / "rows.pt")
    rows = TokenDataset([open_shard(tmp_path / "rows.pt")], 16, 100)
    assert rows.seq_len == 129  # rows fix the length
    with pytest.raises(
        HydraDataError, match=r"rows\.pt: sequences of 129 tokens are longer than the model's max_seq_len 128"
    ):
        rows.check_max_seq_len(128)


def test_eval_batches_are_fixed_and_split_evenly(tmp_path):
    ds, _ = _ds(tmp_path, [1 + 8 * 23], seq_len=8)  # 23 windows
    full = eval_batches(ds, 4, 3)
    assert [b[0].shape[0] for b in full] == [4, 4, 4]
    assert torch.equal(full[0][0][0], torch.from_numpy(ds.window(0)[:-1]))
    parts = [eval_batches(ds, 4, 3, rank=r, world_size=3) for r in range(3)]
    assert len({len(p) for p in parts}) == 1  # equal batch counts on every rank
    seen = sorted(int(x[i, 0]) for p in parts for x, _ in p for i in range(x.shape[0]))
    assert seen == sorted(int(ds.window(i)[0]) for i in range(21))  # 23 windows, cut to a multiple of 3


def test_split_tail_holds_out_the_last_windows(tmp_path):
    ds, _ = _ds(tmp_path, [1 + 5 * 10], seq_len=5)
    head, tail = ds.split_tail(2)
    assert (head.num_windows, tail.num_windows) == (8, 2)
    np.testing.assert_array_equal(tail.window(0), ds.window(8))
    with pytest.raises(HydraDataError, match="too few"):
        ds.split_tail(10)


def test_large_seed_orders_every_epoch_and_small_seeds_keep_their_order(tmp_path):
    # --seed $(date +%s%N) is accepted by torch.manual_seed (< 2**64) but seed * 1_000_003 is not
    ds, _ = _ds(tmp_path, [1 + 6 * 40], seq_len=6)  # exactly 40 windows
    for seed in (1_700_000_000_123_456_789, 2**63 - 1):
        plan = BatchPlan(ds, 8, seed=seed)
        epochs = [[i for k in range(5 * e, 5 * e + 5) for i in plan.window_ids(k)] for e in range(2)]
        assert all(sorted(ids) == list(range(40)) for ids in epochs)
        assert BatchPlan(ds, 8, seed=seed).window_ids(7) == plan.window_ids(7)
    # seeds that worked before keep their order (a resumed run reads the same windows)
    for seed, epoch in ((1337, 0), (-3, 1)):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        want = torch.randperm(40, generator=g)[:8].tolist()
        assert BatchPlan(ds, 8, seed=seed).window_ids(5 * epoch) == want


def test_prefetch_threads_can_share_one_plan(tmp_path):
    # Prefetcher workers call one BatchPlan from several threads; on a small dataset the batches
    # in flight span several epochs, so the permutation cache is filled and evicted concurrently
    n = 100_000  # a randperm long enough to release the GIL while other threads evict
    ds = TokenDataset([open_shard(write_token_shard(tmp_path / "a.bin", np.arange(n + 1) % 7))], 1, 10)
    plan, ref = BatchPlan(ds, 1, seed=4), BatchPlan(ds, 1, seed=4)
    want = {e: ref.window_ids(e * n + 3) for e in range(7)}
    errors: list[str] = []

    def work(t: int) -> None:
        try:
            for i in range(t, t + 60):
                e = i % 7
                assert plan.window_ids(e * n + 3) == want[e]
        except Exception as exc:  # any failure in a worker (a KeyError) fails the test
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows within a few calls
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
