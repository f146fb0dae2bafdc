"""Plumbing every op module shares for its ``torch.library`` registration (keep this file small).

Each op registers its host launchers as ``torch.library.custom_op`` s (namespace
``hydra_kernels``) with ``register_fake`` and ``register_autograd``: that is what
``torch.compile(fullgraph=True)`` traces. In eager mode a custom op costs tens of microseconds of
dispatcher work per call (pytorch/pytorch#176592), which is as long as the kernels themselves at
small sizes, so ops may also run the *same* forward implementation, ``setup_context`` and
``backward`` through a plain ``torch.autograd.Function`` built by :func:`eager_autograd_function`;
the public function picks it when :func:`compiling` is false.

- :func:`run_with_fallback` — launch the Triton kernel; on a run-time failure count it
  (``controls.record_fallback``: counted, warned once) and return the reference's result instead.
- :func:`eager_autograd_function` — the eager twin of a custom op's autograd registration. Its
  ``ctx.eager`` is True, so a shared ``backward`` can call the raw backward implementation
  instead of the (traceable, slower) backward custom op.
- :func:`eager_apply` — such a function's ``apply``, or its bare forward where nothing will be
  differentiated (evaluation, generation): ``apply`` alone costs tens of µs of host time a call.
- :func:`compiling` — whether Dynamo is tracing right now.
- :func:`multiprocessor_count` — streaming multiprocessors of a CUDA device (a small fixed number
  on the CPU, where only the interpreter runs kernels), for sizing persistent-style grids.
- :func:`launch_config_for` — an op's launch table entry for a padded row width and the device's
  GPU generation, with user overrides (``launch_config.resolve_launch_config``) applied.
- :func:`persistent_grid` — (programs, row blocks per program) for a persistent-style grid.
- :func:`device_guard` — makes a tensor's CUDA device current for a launch: Triton launches on
  the current device, which need not be the one holding the tensors (a no-op when it already is).
- :func:`check_devices` — a ValueError naming the argument on another device than the first's.
- :func:`upcast` and :data:`KERNEL_DTYPES` — the references' compute dtype and the dtypes the
  kernels take.
- :func:`cdiv`, :func:`next_power_of_2` — host-side integer helpers. Triton 3.6's functions of
  those names are ``constexpr_function`` objects whose every call from Python goes through a
  wrapper costing microseconds; a launcher calls them several times per op call.
- :func:`dot_operand` (``@triton.jit``) — a ``tl.dot`` operand widened to fp32 under the
  interpreter only (its 16-bit tl.dot is wrong there).
- :func:`to_output_dtype` (``@triton.jit``) — ``v.to(dtype)`` with round-to-nearest-even. GPUs
  round fp32 → bf16 that way natively; Triton 3.6's interpreter truncates instead, which would
  make CPU tests measure the interpreter rather than the kernel, so under the interpreter (only)
  the rounding is done by hand on the bits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.launch_config import LaunchConfig, gpu_generation, resolve_launch_config

#: Launch tables by padded row width: ((largest BLOCK_D, {generation: LaunchConfig}), ...).
WidthTables = tuple[tuple[int, Mapping[str, LaunchConfig]], ...]

T = TypeVar("T")

#: Dtypes the Triton kernels take (fp32 math inside); fp64 runs the PyTorch references in fp64.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: "SM count" used for grids on the CPU (Triton interpreter): small, so that tests with a few
#: hundred rows still give each program several row blocks and exercise the loop tails.
INTERPRETER_SM_COUNT = 4


# Read by to_output_dtype and dot_operand at compile time: on GPUs the branches compile away.
_ROUND_BF16_BY_HAND = tl.constexpr(controls.INTERPRETER_ACTIVE)
_WIDEN_DOT_OPERANDS = tl.constexpr(controls.INTERPRETER_ACTIVE)


@triton.jit
def to_output_dtype(v, dtype: tl.constexpr):
    """Cast fp32 ``v`` to ``dtype`` rounding to nearest even (see the module docstring)."""
    if _ROUND_BF16_BY_HAND and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)  # round half to even on the 16 dropped bits
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(v != v, v.to(dtype), rounded)  # keep NaN a NaN
    else:
        return v.to(dtype)


@triton.jit
def dot_operand(x):
    """``x`` as a ``tl.dot`` operand: unchanged on GPUs; widened to fp32 under Triton 3.6's
    interpreter, whose tl.dot returns garbage on bf16/fp16 operands (exact: products of 16-bit
    floats fit in fp32)."""
    if _WIDEN_DOT_OPERANDS:
        return x.to(tl.float32)
    else:
        return x


def upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for half types, unchanged for fp32/fp64 (so an fp64 reference really is fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def run_with_fallback(op: str, launch: Callable[[], T], reference: Callable[[], T]) -> T:
    """``launch()``; if it raises, record the failure for ``op`` and return ``reference()``.

    Out-of-memory is re-raised: it is not a kernel fault and the reference would need memory too.
    """
    try:
        return launch()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        controls.record_fallback(op, exc)
        return reference()


def compiling() -> bool:
    """True while torch.compile traces (the public functions then call the custom op)."""
    return torch.compiler.is_compiling()


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return INTERPRETER_SM_COUNT


def launch_config_for(op: str, device: torch.device, block_d: int, tables: WidthTables) -> LaunchConfig:
    """The entry of ``tables`` for this padded width and device generation, overrides applied."""
    for widest, table in tables:
        if block_d <= widest:
            cfg = resolve_launch_config(op, device, table)
            break
    else:
        raise ValueError(f"{op}: padded width {block_d} is beyond every launch table")
    if cfg.block_rows & (cfg.block_rows - 1):
        raise ValueError(f"{op}: block_rows={cfg.block_rows} must be a power of two")
    return cfg


def persistent_grid(
    n_blocks: int, device: torch.device, programs_per_sm: Mapping[str, int]
) -> tuple[int, int]:
    """(programs, row blocks per program) for about ``programs_per_sm[generation]`` programs per
    SM. The per-program count is a power of two: kernels take it as a compile-time trip count
    (the Triton interpreter cannot loop to a run-time bound), and powers of two keep the number
    of compiled variants small; the program count then lands between half the target and it."""
    per_sm = programs_per_sm.get(gpu_generation(device), programs_per_sm["default"])
    target = max(1, per_sm * multiprocessor_count(device))
    iters = next_power_of_2(cdiv(n_blocks, target))
    return cdiv(n_blocks, iters), iters


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(t.device)`` for a CUDA tensor off the current device, else a no-op."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def check_devices(op: str, names: str, first: torch.Tensor, *others: torch.Tensor | None) -> None:
    """Raise a ValueError naming the first of ``others`` (None: an absent argument) that is not on
    ``first``'s device; ``names`` are the arguments' names, space-separated, ``first``'s first.

    Why every op checks: a kernel launches on one device and reads each pointer there, so a tensor
    on another GPU is an illegal memory access (or a silent peer read), and one elsewhere made the
    launch fail and the reference either raise an error naming no argument or, for the in-place
    decode ops, run on the foreign tensor. Metadata only (about 0.1 µs a tensor, no sync), and
    static under torch.compile; the loop is kept bare because it runs on every call."""
    device = first.device
    for t in others:
        if t is not None and t.device != device:
            # by identity: tuple.index would compare tensors with ==
            label = names.split()[1 + next(i for i, o in enumerate(others) if o is t)]
            raise ValueError(
                f"{op}: {label} {tuple(t.shape)} {t.dtype} is on {t.device} but {names.split()[0]} is on "
                f"{device}; pass every tensor of the call on one device"
            )


def eager_autograd_function(
    name: str,
    forward: Callable[..., Any],
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` running ``forward(*inputs)`` directly, then the custom op's
    own ``setup_context(ctx, inputs, output)``; ``backward(ctx, *grads)`` is shared too (once
    differentiable: a double backward raises instead of returning wrong second derivatives)."""

    def _forward(ctx: Any, *inputs: Any) -> Any:
        output = forward(*inputs)
        ctx.eager = True
        setup_context(ctx, inputs, output)
        return output

    # The kernels' backward is not differentiable: under create_graph=True it goes through
    # once_differentiable (a double backward then raises instead of returning wrong second
    # derivatives). The usual backward runs with grad mode off and skips that wrapper's
    # no_grad() context, a few microseconds of every call.
    once = torch.autograd.function.once_differentiable(backward)

    def _backward(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            return once(ctx, *grads)
        return backward(ctx, *grads)

    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(_forward),
            "backward": staticmethod(_backward),
            "raw_forward": staticmethod(forward),
        },
    )


def eager_apply(function: type[torch.autograd.Function], *inputs: Any) -> Any:
    """``function.apply(*inputs)`` for a function from :func:`eager_autograd_function`, or, where
    nothing will be differentiated (grad mode off, or no input that requires grad), its forward
    alone: ``apply`` costs tens of microseconds of host time per call even then (measured in an
    eager prefill on an H200 host: 30–70 µs a call; packages/hydra-model/BENCHMARKS.md), as long
    as a small kernel takes on the GPU."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return function.apply(*inputs)
    return function.raw_forward(*inputs)
