"""Kernel launches with little host work: per-shape launch plans that call compiled kernels directly.

Why: at the benchmark shapes one eager forward+backward of a norm or an activation is 20-250 µs
of GPU work, and on the H100 host measured by ``packages/hydra-diag/bench/tune.py`` the autograd
machinery alone takes ~120 µs of host time per forward+backward, a ``kernel[grid](...)`` launch ~20 µs and a
direct call of the compiled kernel ~12 µs; whatever the launchers add on top decides whether an
eager call keeps the GPU busy. So each op's launcher derives its launch once per input layout
(a :class:`LaunchPlan`, kept in a :func:`plan_cache`) instead of once per call.

:class:`LaunchPlan` holds one kernel, its grid and its compile-time arguments. The first call
launches through Triton's JIT (which compiles the kernel or finds it in its cache). If every
pointer argument was 16-byte aligned, the compiled kernel is kept, and later calls whose pointers
are aligned as well call it directly — skipping the JIT's per-call argument binding, cache-key
hashing and launch-hook bookkeeping. Integer arguments are not re-examined: a plan is keyed by
everything its integer arguments derive from (shapes, strides, device), so they, and Triton's
specialisation on them, cannot differ between calls of one plan. Calls with a misaligned pointer,
calls while Triton launch hooks are installed (profilers), and the Triton interpreter always take
the JIT path. Direct calls are on by default; ``HYDRA_FAST_LAUNCH=0`` switches them off (see
:data:`FAST_LAUNCH`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import register_dependent_cache

#: Direct calls of compiled kernels (see the module docstring); read at import. On unless
#: ``HYDRA_FAST_LAUNCH=0``: on the H100 ``hydra-kernels check`` (every op twice, the second call
#: bitwise equal to the first) passed with them, and they took an RMSNorm forward + backward at
#: 16384×768 from 0.70 to 0.22 ms of wall time (BENCHMARKS.md). A launcher that rejects the call
#: switches them off for the process and says why in ``get_kernel_status()["fast_launch"]``.
FAST_LAUNCH: bool = not controls.INTERPRETER_ACTIVE and os.environ.get(
    "HYDRA_FAST_LAUNCH", "1"
).strip().lower() not in ("0", "false", "no", "off")

#: Why direct calls were switched off at run time (None while they work or were never tried).
fast_launch_error: str | None = None

_hooks: Any = None  # triton.knobs.runtime, once a GPU launch happened
_current_stream: Any = None  # Triton's own "current raw CUDA stream of device i" getter


def empty_like_contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``t``'s shape (and dtype unless given). ``torch.empty_like``
    parses its arguments several times faster than ``torch.empty(shape, dtype=, device=)``."""
    if dtype is None or dtype == t.dtype:
        if t.is_contiguous():
            return torch.empty_like(t)
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def plan_cache() -> dict:
    """A dict of launch plans, emptied whenever launch configurations may change."""
    return register_dependent_cache({})


def _bind_runtime() -> bool:
    global _hooks, _current_stream
    try:
        from triton import knobs
        from triton.runtime import driver

        hooks = knobs.runtime
        if not (
            isinstance(hooks.launch_enter_hook.calls, list) and isinstance(hooks.launch_exit_hook.calls, list)
        ):
            raise TypeError("triton.knobs.runtime launch hooks are not HookChains")
        _hooks, _current_stream = hooks, driver.active.get_current_stream
        return True
    except Exception as exc:  # another Triton layout: keep launching through the JIT
        _disable(exc)
        return False


def _disable(exc: BaseException) -> None:
    global FAST_LAUNCH, fast_launch_error
    FAST_LAUNCH = False
    fast_launch_error = f"{type(exc).__name__}: {exc}"[:300]


class LaunchPlan:
    """``fn[grid](*runtime_args, **constexprs, num_warps=..., num_stages=...)`` for one input
    layout on one device; call it with the runtime arguments only (the kernel's leading
    parameters, in order; its ``tl.constexpr`` parameters must be the trailing ones). A runtime
    argument may be a tuple of tensors (a kernel's pointer tuple): each is checked as a pointer."""

    __slots__ = ("compiled", "device", "fn", "grid", "kwargs", "pointers", "tail", "tuples")

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        constexprs: dict[str, Any],
        num_warps: int,
        num_stages: int,
        device: int,
        options: dict[str, Any] | None = None,
    ):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        # options: other compile options of Triton's launch (e.g. enable_fp_fusion)
        self.kwargs = {**constexprs, "num_warps": num_warps, "num_stages": num_stages, **(options or {})}
        names = list(fn.arg_names)
        trailing = names[len(names) - len(constexprs) :]
        if sorted(trailing) != sorted(constexprs):
            raise ValueError(
                f"{names}: compile-time arguments {sorted(constexprs)} must be the trailing ones"
            )
        self.tail = tuple(constexprs[name] for name in trailing)
        self.device = device
        self.compiled: Any = None
        self.pointers: tuple[int, ...] = ()
        self.tuples: tuple[int, ...] = ()  # arguments that are tuples of tensors

    def __call__(self, *args: Any) -> None:
        kernel = self.compiled
        if kernel is not None:
            bits = 0
            for i in self.pointers:
                bits |= args[i].data_ptr()
            for i in self.tuples:
                for t in args[i]:
                    bits |= t.data_ptr()
            if not bits & 15 and not (_hooks.launch_enter_hook.calls or _hooks.launch_exit_hook.calls):
                g, stream = self.grid, _current_stream(self.device)
                try:  # (grid, stream, function, metadata, launch metadata, enter/exit hooks, arguments)
                    kernel.run(
                        g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                        None, None, None, *args, *self.tail,
                    )  # fmt: skip
                    return
                except TypeError as exc:  # this Triton's launcher takes other arguments
                    _disable(exc)
                    self.compiled = None
        self._jit_launch(args)

    def _jit_launch(self, args: tuple[Any, ...]) -> None:
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if not FAST_LAUNCH or self.compiled is not None or kernel is None:
            return
        if _hooks is None and not _bind_runtime():
            return
        pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        tuples = tuple(i for i, a in enumerate(args) if isinstance(a, tuple))
        bits = 0
        for i in pointers:
            bits |= args[i].data_ptr()
        for i in tuples:
            if not all(isinstance(t, torch.Tensor) for t in args[i]):
                return  # a tuple of other things: Triton specialises on it; keep the JIT
            for t in args[i]:
                bits |= t.data_ptr()
        usable = all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))
        if bits & 15 or not usable:
            return
        self.compiled, self.pointers, self.tuples = kernel, pointers, tuples
