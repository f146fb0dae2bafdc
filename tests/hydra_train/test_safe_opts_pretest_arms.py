"""The pretest's arm plan: each arm once, compile in the second phase on the bases that passed."""

from __future__ import annotations

import pytest

from hydra_train.config import TrainConfig
from hydra_train.safe_opts.pretest_arms import first_arms, stacked_arms
from hydra_train.safe_opts.registry import build_registry


@pytest.fixture
def reg():
    return build_registry(TrainConfig())


def test_static_routing_runs_once_as_the_static_graphs_reference_and_a_result(reg):
    arms = first_arms(reg, ["cuda_graphs", "static_routing", "compile"], ("dynamic", "static"))
    keys = [a.key for a in arms]
    assert keys == ["default", "cuda_graphs", "static_routing", "cuda_graphs[static]"]
    static = arms[2]
    assert static.tested == "static_routing" and not static.hidden
    assert arms[3].ref == "static_routing"
    # only the graph asks for it: a hidden reference
    arms = first_arms(reg, ["cuda_graphs"], ("static",))
    assert [(a.key, a.hidden) for a in arms] == [
        ("default", False),
        ("static_routing", True),
        ("cuda_graphs[static]", False),
    ]


@pytest.mark.parametrize(
    ("passed", "opts", "ref", "hidden"),
    [
        (("triton_kernels", "fa3"), ["triton_kernels", "fa3", "compile"], "triton_kernels+fa3", True),
        (("fa3",), ["fa3", "compile"], "fa3", False),
        ((), ["compile"], "default", False),
    ],
)
def test_compile_is_stacked_on_the_bases_that_passed(reg, passed, opts, ref, hidden):
    results = {n: {"status": "PASS" if n in passed else "FAIL"} for n in ("triton_kernels", "fa3")}
    arms = stacked_arms(reg, ["triton_kernels", "fa3", "compile"], results)
    assert arms[-1].key == "compile" and arms[-1].opts == opts and arms[-1].ref == ref
    assert (len(arms) == 2) == hidden and all(a.hidden for a in arms[:-1])
    assert stacked_arms(reg, ["triton_kernels", "fa3"], results) == []  # compile not asked for
