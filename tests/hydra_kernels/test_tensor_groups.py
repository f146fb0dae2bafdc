"""_tensor_groups: the launch tables of the many-tensor kernels (total_norm, adamw), by hand; the
plan cache's limit (least recently used dropped first) and its refusal inside a CUDA graph capture."""

import pytest
import torch

from hydra_kernels.ops._tensor_groups import NEVER, TensorGroups, cached_plan, padded


def test_groups_and_tables_by_hand():
    # sizes 130, 0, 5, 64 with keys a, b, a, a; groups of 2, blocks of 64
    plan = TensorGroups([130, 0, 5, 64], ["a", "b", "a", "a"], 2, 64, torch.device("cpu"))
    # key order a: 0, 2, 3; then b: 1. Groups: [0, 2], [3], [1] (a group holds one key)
    assert [(m, first, n) for m, first, n in plan.groups] == [([0, 2], 0, 4), ([3], 4, 1), ([1], 5, 1)]
    assert plan.programs == 6
    assert plan.tables.tolist() == [
        [0, 3, 130, 5],  # firsts: tensor 0 takes programs 0-2, tensor 2 program 3
        [0, NEVER, 64, 0],  # a padded entry is never picked
        [0, NEVER, 0, 0],  # an empty tensor still gets one program, which reads nothing
    ]
    ts = [torch.zeros(n) for n in (130, 0, 5, 64)]
    assert padded(ts, [3], 2) == (ts[3], ts[3])


def test_cached_plan_limit_drops_the_least_recently_used():
    """At the limit one plan goes, the least recently used: the plans a step keeps using stay
    (dropping them all made an optimizer of more groups than the limit rebuild each at every step)."""
    cache, made = {}, []

    def make():
        made.append(1)
        return TensorGroups([3], [0], 4, 8, torch.device("cpu"))

    get = lambda key: cached_plan(cache, key, make, "op", torch.device("cpu"), 2)
    first = get("k")
    assert get("k") is first and len(made) == 1
    get("k2")
    assert get("k") is first  # k used after k2: k2 is now the least recently used
    get("k3")
    assert list(cache) == ["k", "k3"] and cache["k"] is first and len(made) == 3
    for _ in range(3):  # two plans used in turn at a limit of two: none built again
        get("k")
        get("k3")
    assert len(made) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_new_plan_inside_a_capture_is_refused():
    dev = torch.device("cuda")
    message = "my_op: a new set of tensor sizes inside a CUDA graph capture"
    with pytest.raises(RuntimeError, match=message), torch.cuda.graph(torch.cuda.CUDAGraph()):
        cached_plan({}, "k", lambda: TensorGroups([3], [0], 4, 8, dev), "my_op", dev, 4)


def test_plans_used_in_a_capture_outlive_the_limit():
    """A captured graph reads its plan's table at every replay: the cache never drops such a plan."""
    cache = {}
    make = lambda: TensorGroups([3], [0], 4, 8, torch.device("cpu"))
    kept = cached_plan(cache, "k", make, "op", torch.device("cpu"), 2)
    kept.captured = True  # what cached_plan records when the call comes inside a capture
    cached_plan(cache, "k2", make, "op", torch.device("cpu"), 2)
    cached_plan(cache, "k3", make, "op", torch.device("cpu"), 2)
    assert cache == {"k": kept, "k3": cache["k3"]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_marks_its_plan_kept():
    dev = torch.device("cuda")
    cache = {}
    make = lambda: TensorGroups([3], [0], 4, 8, dev)
    plan = cached_plan(cache, "k", make, "op", dev, 2)
    assert not plan.captured
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert cached_plan(cache, "k", make, "op", dev, 2) is plan
    assert plan.captured


def test_group_launches_are_built_once_per_key():
    plan = TensorGroups([100, 5, 7], [0, 0, 0], 2, 8, torch.device("cpu"))

    class Fn:  # a jitted function's stand-in: its parameter names
        arg_names = ("PTRS", "n", "BLOCK")

    fn = Fn()
    first = plan.launch(0, fn, {"BLOCK": 8}, 4)
    assert plan.launch(0, fn, {"BLOCK": 8}, 4) is first
    assert first.grid == (13 + 1, 1, 1)  # group 0: tensors 0 and 1, 13 + 1 programs of 8
    assert plan.launch(1, fn, {"BLOCK": 8}, 4).grid == (1, 1, 1)
    assert plan.launch(0, fn, {"BLOCK": 8}, 4, key=torch.float64) is not first
    assert plan.launch(0, fn, {"BLOCK": 8}, 8) is not first
