"""ops._launch.LaunchPlan: which calls go to the compiled kernel directly and which through the JIT
(direct calls switched on here as HYDRA_FAST_LAUNCH=1 would).

A GPU is not needed: a stand-in for ``@triton.jit`` functions and their compiled kernels records
what each call does. (On a GPU, ``hydra-kernels check`` runs every op twice and requires the
second call — the direct launch — to return bitwise the first call's results.)
"""

import pytest
import torch

from hydra_kernels import get_kernel_status
from hydra_kernels.launch_config import clear_launch_overrides, set_launch_overrides
from hydra_kernels.ops import _launch


class _Hook:
    def __init__(self) -> None:
        self.calls: list = []


class _Runtime:  # what triton.knobs.runtime offers the launcher
    def __init__(self) -> None:
        self.launch_enter_hook, self.launch_exit_hook = _Hook(), _Hook()


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def run(self, *args):
        if self.fail:
            raise TypeError("launcher wants other arguments")
        self.log.append(("direct", args))


class _JitFn:
    arg_names = ("A", "B", "n", "BLOCK", "FLAG")

    def __init__(self, fail_direct: bool = False) -> None:
        self.log: list = []
        self.fail_direct = fail_direct

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log, self.fail_direct)

        return launch


@pytest.fixture
def fast(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(_launch, "fast_launch_error", None)
    monkeypatch.setattr(_launch, "_hooks", runtime)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 1000 + device)
    return runtime


def _plan(fn):
    return _launch.LaunchPlan(fn, (5,), {"BLOCK": 64, "FLAG": True}, 4, 2, 3)


def test_second_call_goes_to_the_compiled_kernel_with_all_arguments_in_order(fast):
    fn = _JitFn()
    plan = _plan(fn)
    a, b = torch.zeros(64), torch.zeros(64)
    plan(a, b, 7)
    plan(a, b, 7)
    assert fn.log[0] == (
        "jit",
        (5, 1, 1),
        (a, b, 7),
        {"BLOCK": 64, "FLAG": True, "num_warps": 4, "num_stages": 2},
    )
    kind, args = fn.log[1]
    assert kind == "direct"
    assert args == (5, 1, 1, 1003, "fn-handle", "meta", None, None, None, a, b, 7, 64, True)


def test_misaligned_pointer_or_installed_hooks_take_the_jit(fast):
    fn = _JitFn()
    plan = _plan(fn)
    a, b = torch.zeros(64), torch.zeros(64)
    plan(a, b, 7)
    plan(a[1:], b, 7)  # 4 bytes off a 16-byte boundary
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]
    fast.launch_enter_hook.calls.append(print)  # a profiler listening to launches
    plan(a, b, 7)
    assert fn.log[-1][0] == "jit"


def test_first_call_with_a_misaligned_pointer_never_caches(fast):
    fn = _JitFn()
    plan = _plan(fn)
    a, b = torch.zeros(64), torch.zeros(64)
    plan(a[1:], b, 7)
    plan(a, b, 7)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"] and plan.compiled is not None
    plan(a, b, 7)
    assert fn.log[-1][0] == "direct"


def test_pointer_tuples_are_checked_element_by_element(fast):
    """A kernel's pointer tuple (the many-tensor ops') goes to the compiled kernel as the tuple,
    and a misaligned member anywhere in it sends the call through the JIT."""
    fn = _JitFn()
    plan = _plan(fn)
    a, b, c = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    plan((a, b), c, 7)
    plan((a, b), c, 7)
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]
    assert fn.log[1][1][9:] == ((a, b), c, 7, 64, True)
    plan((a, b[1:]), c, 7)  # the second member 4 bytes off a 16-byte boundary
    assert fn.log[-1][0] == "jit"
    plan((b, a), c, 7)
    assert fn.log[-1][0] == "direct"


def test_a_tuple_of_non_tensors_never_caches(fast):
    fn = _JitFn()
    plan = _plan(fn)
    c = torch.zeros(64)
    for _ in range(2):
        plan((1, 2), c, 7)
    assert [entry[0] for entry in fn.log] == ["jit", "jit"] and plan.compiled is None


def test_a_launcher_that_rejects_the_call_switches_direct_launches_off(fast):
    fn = _JitFn(fail_direct=True)
    plan = _plan(fn)
    a, b = torch.zeros(64), torch.zeros(64)
    plan(a, b, 7)
    plan(a, b, 7)  # direct call raises TypeError: relaunched through the JIT, fast path off
    assert [entry[0] for entry in fn.log] == ["jit", "jit"]
    assert _launch.FAST_LAUNCH is False and "launcher wants other arguments" in _launch.fast_launch_error
    assert get_kernel_status()["fast_launch"] == {"enabled": False, "error": _launch.fast_launch_error}


def test_constexprs_must_be_the_trailing_parameters():
    with pytest.raises(ValueError, match="trailing"):
        _launch.LaunchPlan(_JitFn(), (1,), {"n": 3, "FLAG": True}, 4, 2, 0)


def test_plan_caches_are_emptied_when_launch_configurations_change():
    cache = _launch.plan_cache()
    cache["key"] = "plan"
    set_launch_overrides("rms_norm", num_warps=2)
    assert not cache
    cache["key"] = "plan"
    clear_launch_overrides()
    assert not cache
