"""Kernels a piece of PyTorch code launches, counted on the CPU: what a CUDA graph of it would replay.

At batch 1 a decode step is bound by its number of kernels, not by arithmetic, so the count is a
figure worth having without a GPU. :class:`KernelCount` counts, by name, each aten operator that
launches a kernel of its own (views, metadata and host-side scalars count none: :data:`NO_KERNEL`)
and each Triton launch once; with ``TRITON_INTERPRET=1`` the interpreter runs a Triton kernel as
many small tensor operations, which are not counted.
"""

from __future__ import annotations

import collections

import triton.runtime.interpreter as triton_interpreter
from torch.utils._python_dispatch import TorchDispatchMode

#: aten operators that launch no kernel of their own (views, metadata, scalars on the host)
NO_KERNEL = frozenset((
    "view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze",
    "squeeze", "t", "transpose", "permute", "alias", "detach", "unbind", "split", "split_with_sizes",
    "chunk", "narrow", "_reshape_alias", "lift_fresh", "view_as_real", "view_as_complex", "diagonal",
    "unfold", "empty", "empty_like", "empty_strided", "new_empty", "sym_size", "sym_stride",
    "sym_numel", "is_nonzero", "_local_scalar_dense", "item", "promote_types", "result_type", "set_",
    "scalar_tensor",
))  # fmt: skip


class KernelCount(TorchDispatchMode):
    """``with KernelCount() as c: ...`` → ``c.kernels``: kernels by name, aten operators outside
    Triton launches and ``triton:<kernel>`` once per launch."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and name not in NO_KERNEL:
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        original, counter = triton_interpreter.GridExecutor.__call__, self

        def launch(grid_executor, *args, **kwargs):
            if not counter.in_triton:
                counter.kernels["triton:" + getattr(grid_executor.fn, "__name__", "kernel")] += 1
            counter.in_triton += 1
            try:
                return original(grid_executor, *args, **kwargs)
            finally:
                counter.in_triton -= 1

        self._restore = original
        triton_interpreter.GridExecutor.__call__ = launch
        return super().__enter__()

    def __exit__(self, *exc):
        triton_interpreter.GridExecutor.__call__ = self._restore
        return super().__exit__(*exc)
