"""Numerical check of every public op, forward and backward, against a float64 reference.

For each op and dtype, fresh random inputs of odd shapes go through three runs: the public
function (Triton where this device has a Triton path), the op's PyTorch reference in the same
dtype, and the reference in float64. Each output and each gradient must meet the project's
criterion (:mod:`hydra_kernels.numerics`)::

    |public − ref64| ≤ 2·|reference_same_dtype − ref64| + atol

The float64 run intercepts ``.float()``/``.to(torch.float32)`` on float64 tensors (they return
the tensor unchanged), so a reference that upcasts half types to fp32 for its statistics still
computes in float64 here. The check is what ``hydra-kernels check`` runs.
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hydra_kernels import controls
from hydra_kernels.numerics import check_against_fp64, fp32_noise_atol
from hydra_kernels.registry import OP_SPECS, Check, canonical_op

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CheckCase:
    """One public function under check: its registry entry (:class:`hydra_kernels.registry.Check`:
    input maker, shapes, tolerances), the op whose switch and fallbacks it uses, and the function
    and reference resolved in the op's module."""

    check: Check
    control_op: str
    fn: Callable[..., Any]
    ref: Callable[..., Any]

    def __getattr__(self, name: str) -> Any:  # name, make, quick_shapes, ... of the entry
        if name == "check":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.check, name)


@dataclass
class CheckResult:
    op: str
    dtype: str
    shape: str
    backend: str
    passed: bool
    worst_ratio: float | None
    worst_item: str | None
    seed: int
    items: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


#: Every registered op's checks (hydra_kernels.registry).
CASES: tuple[CheckCase, ...] = tuple(
    CheckCase(c, spec.name, spec.function(c.fn), spec.function(c.ref))
    for spec in OP_SPECS
    for c in spec.checks
)


#: The names ``hydra-kernels check --op`` takes, in the registry's order.
CHECK_NAMES: tuple[str, ...] = tuple(c.name for c in CASES)
#: The largest ``seed``, as large as a fresh one (4 random bytes). The checks take seed, seed + 1,
#: ...: far inside the 64 bits torch's generator takes, which refused a larger seed with an
#: "Overflow when unpacking long long" that named no option.
MAX_SEED = 2**32 - 1


class _KeepFloat64(TorchFunctionMode):
    """Inside: casting a float64 tensor to float32 returns it unchanged (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_fp32 = func is torch.Tensor.float or (
            func is torch.Tensor.to and _target_dtype(args[1:], kwargs) == torch.float32
        )
        if to_fp32 and args and _is_f64(args[0]):
            return args[0]
        return func(*args, **kwargs)


def _is_f64(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float64


def _target_dtype(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.dtype | None:
    for a in (*args, kwargs.get("dtype")):
        if isinstance(a, torch.dtype):
            return a
    return None


def _cast(args: list[Any], dtype: torch.dtype, device: torch.device, grad_idx: list[int]) -> list[Any]:
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = a.to(device=device, dtype=dtype if a.is_floating_point() else a.dtype)
            a.requires_grad_(i in grad_idx)
        out.append(a)
    return out


def _fwd_bwd(fn, args, grad_idx, grad_outs: list[torch.Tensor] | None, gen: torch.Generator):
    outs = fn(*args)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if grad_outs is None:  # first run: draw the incoming gradients in the outputs' dtypes
        grad_outs = [_randn(gen, *o.shape).to(o.dtype) for o in outs]
    gos = [g.to(device=o.device, dtype=o.dtype) for g, o in zip(grad_outs, outs, strict=True)]
    grads = torch.autograd.grad(outs, [args[i] for i in grad_idx], gos, allow_unused=True)
    return [o.detach() for o in outs], list(grads), grad_outs


def _check_one(case: CheckCase, shape, dtype: torch.dtype, device: torch.device, seed: int) -> CheckResult:
    gen = torch.Generator().manual_seed(seed)
    args64, grad_idx = case.make(shape, gen)
    # Every run sees the same values: the inputs rounded to ``dtype`` (exact again in float64),
    # so the comparison measures the computation, not the rounding of the inputs.
    rounded = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args64]
    dname = next(k for k, v in DTYPES.items() if v == dtype)
    k_args = _cast(rounded, dtype, device, grad_idx)
    tensors = [a for a in k_args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    backend = "triton" if controls.triton_path(case.control_op, *tensors) else "reference"
    result = CheckResult(case.name, dname, "x".join(map(str, shape)), backend, False, None, None, seed)
    before = controls.fallback_counts()[case.control_op]
    try:
        k_out, k_grads, grad_outs = _fwd_bwd(case.fn, k_args, grad_idx, None, gen)
        if case.repeatable:
            # The second call takes the cached launch plan (and, on a GPU, the direct launch of
            # the compiled kernel): it must compute exactly what the first call computed.
            again = _fwd_bwd(case.fn, _cast(rounded, dtype, device, grad_idx), grad_idx, grad_outs, gen)
            for name, a, b in zip(("out", "grad"), (k_out, k_grads), again[:2], strict=True):
                same = [
                    x is y or (x is not None and y is not None and torch.equal(x, y))
                    for x, y in zip(a, b, strict=True)
                ]
                if not all(same):
                    raise AssertionError(f"a second call returned other {name} values than the first")
        t_args = _cast(rounded, dtype, device, grad_idx)
        t_out, t_grads, _ = _fwd_bwd(case.ref, t_args, grad_idx, grad_outs, gen)
        with _KeepFloat64():
            r_args = _cast(rounded, torch.float64, device, grad_idx)
            r_out, r_grads, _ = _fwd_bwd(case.ref, r_args, grad_idx, grad_outs, gen)
    except Exception as exc:  # a crash is a failed check, reported with its message
        result.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        return result
    names = [f"out{i}" for i in range(len(k_out))] + [f"grad[{i}]" for i in grad_idx]
    extra = [0.0] * len(k_out) + (
        list(case.grad_atol(k_args, dtype, grad_outs)) if case.grad_atol else [0.0] * len(grad_idx)
    )
    reduction = "elementwise" if dtype == torch.float32 else case.half_reduction
    worst, worst_name, passed = 0.0, None, True
    for name, k, t, r, e in zip(names, k_out + k_grads, t_out + t_grads, r_out + r_grads, extra, strict=True):
        if r is None or k is None or t is None:
            passed = passed and k is None and r is None
            result.items[name] = "no gradient" if k is None else "unexpected gradient"
            continue
        verdict = _criterion(k, t, r, e, reduction)
        result.items[name] = verdict.describe()
        passed = passed and verdict.passed
        if verdict.worst_ratio >= worst:
            worst, worst_name = verdict.worst_ratio, name
    fell_back = controls.fallback_counts()[case.control_op] - before
    if fell_back:
        passed = False
        result.error = f"the Triton kernel raised {fell_back}x and the reference answered instead"
    result.passed, result.worst_ratio, result.worst_item = passed, worst, worst_name
    return result


def _criterion(k: torch.Tensor, t: torch.Tensor, r: torch.Tensor, extra, reduction: str):
    """numerics.check_against_fp64 with atol = fp32 noise + ``extra`` (a number or an elementwise
    tensor; the criterion is unchanged when k, t, r and atol are all divided by atol)."""
    atol = fp32_noise_atol(r)
    if isinstance(extra, torch.Tensor):
        scale = atol + extra.detach().to(device="cpu", dtype=torch.float64)
        k, t, r = (v.detach().to(device="cpu", dtype=torch.float64) / scale for v in (k, t, r))
        return check_against_fp64(k, t, r, 1.0, reduction)
    return check_against_fp64(k, t, r, atol + extra, reduction)


def check_mode(device: torch.device) -> str:
    """What a check on ``device`` exercises, in words."""
    if controls.use_triton_kernels() and controls.device_supports_triton(device):
        where = "under the Triton interpreter on the CPU" if device.type == "cpu" else f"on {device}"
        return f"Triton kernels {where}"
    return (
        f"references only: no Triton path on {device} (no CUDA, TRITON_INTERPRET unset, or "
        "kernels switched off), so the public functions run the PyTorch references"
    )


def default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def run_checks(
    quick: bool = False,
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    device: torch.device | None = None,
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Check each selected op (all by default; an alias of registry.OP_ALIASES is taken too) in
    each dtype; fresh inputs unless ``seed`` (0 to :data:`MAX_SEED`)."""
    ops = [canonical_op(o) for o in ops or ()]
    unknown = [o for o in ops if o not in CHECK_NAMES]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(CHECK_NAMES)}")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        # torch's generator would answer "Overflow when unpacking long long", naming nothing
        raise ValueError(f"seed {seed} is out of range: choose one from 0 to {MAX_SEED}")
    bad = sorted(set(dtypes) - set(DTYPES))
    if bad:
        raise ValueError(f"unknown dtype(s) {bad}; expected some of {list(DTYPES)}")
    device = device or default_device()
    base = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    results = []
    for case in CASES:
        if ops and case.name not in ops:
            continue
        for shape in case.quick_shapes if quick else case.full_shapes:
            for dname in dtypes:
                if progress:
                    progress(f"{case.name} {dname} {'x'.join(map(str, shape))}")
                run_seed = base + len(results)
                results.append(_check_one(case, shape, DTYPES[dname], device, run_seed))
    return results
