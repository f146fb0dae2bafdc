"""The ops of hydra_kernels, one entry each: everything the package's tooling needs to know.

A new kernel op is its module (``ops/<op>.py``: kernels, launcher, autograd Function or
``torch.library`` op, and the ``<op>_ref`` reference), ONE :class:`OpSpec` in :data:`OP_SPECS`
below (the check inputs and bench workloads it names in :mod:`hydra_kernels.registry_checks` and
:mod:`hydra_kernels.registry_bench`), and its test (``tests/hydra_kernels/test_<op>.py``). From
the entry: the op's switch and environment variables (:mod:`hydra_kernels.controls`), the names
``hydra_kernels`` exports, the numerical checks of ``hydra-kernels check``
(:mod:`hydra_kernels.checks`), the workloads of ``hydra-kernels bench`` and
:func:`hydra_kernels.benchmark_kernels` (:mod:`hydra_kernels.bench`) and the launch tables
``hydra-kernels status`` shows (:mod:`hydra_kernels.cli`).

Functions are named, not imported: this module is read while the ops' own modules import
:mod:`hydra_kernels.controls`, so it imports nothing of hydra_kernels at module level but the
entries' check inputs (:mod:`hydra_kernels.registry_checks`) and bench workloads
(:mod:`hydra_kernels.registry_bench`), which import nothing of it either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_kernels.registry_bench import (  # noqa: F401 (the shapes: kept importable here)
    CCGQA_CONV_SHAPES,
    PRESET_HEAD_SHAPES,
    _bench_add_rms,
    _bench_ccgqa_conv,
    _bench_linear_ce,
    _bench_qk_norm,
    _bench_qk_norm_rope,
    _bench_rms,
    _bench_rope,
    _bench_swiglu,
    _small_linear_ce,
    _small_qk_norm,
    _small_qk_norm_rope,
    _small_rope,
)
from hydra_kernels.registry_checks import (
    _check_add_rms,
    _check_ccgqa_conv,
    _check_ccgqa_conv_qk_mean,
    _check_ccgqa_conv_zero_context,
    _check_linear_ce,
    _check_qk_norm,
    _check_qk_norm_rope,
    _check_rms,
    _check_rope,
    _check_swiglu,
    _check_swiglu_packed,
    _linear_ce_grad_atol,
)

#: make(shape, gen) -> (positional arguments, float64 on the CPU; indices to differentiate)
Maker = Callable[[tuple[int, ...], torch.Generator], tuple[list[Any], list[int]]]


@dataclass(frozen=True)
class Check:
    """One public function of the op, checked against float64 by ``hydra-kernels check``.

    ``fn``/``ref`` name the function and its reference in the op's module. Two knobs follow the
    op owners' own tests: ``half_reduction`` is the criterion's reduction in bf16/fp16 (``"max"``
    where the op rounds an intermediate to the low precision, see :mod:`hydra_kernels.numerics`),
    and ``grad_atol`` names a function of the module giving elementwise gradient tolerances."""

    name: str
    fn: str
    ref: str
    make: Maker
    quick_shapes: tuple[tuple[int, ...], ...]
    full_shapes: tuple[tuple[int, ...], ...]
    half_reduction: str = "elementwise"
    grad_atol: Callable[..., Sequence[torch.Tensor]] | None = None
    repeatable: bool = True  # a second call must return bitwise the same (no cuBLAS inside)


@dataclass(frozen=True)
class OpSpec:
    """One op (see the module docstring)."""

    name: str  # its switch in hydra_kernels.controls, and the key of its launch tables
    module: str
    title: str  # for tables
    exports: tuple[str, ...]  # what ``import hydra_kernels`` offers of it
    env: str  # HYDRA_ENABLE_<env> / HYDRA_DISABLE_<env>: its Triton forward (and backward)
    env_bwd: str | None  # the same for its backward alone, if it has a fused one
    checks: tuple[Check, ...]
    #: ``hydra-kernels bench --op`` name -> workloads(dev, dtype, liger peers, why none) (bench.py)
    bench: dict[str, Callable[..., Iterator[Any]]] = field(default_factory=dict)
    #: ``hydra-kernels bench --sweep``: launch configurations to try, and the table they replace
    sweep: tuple[dict[str, int], ...] = ()
    sweep_table: str = ""
    #: ``benchmark_kernels``: inputs of the first check's function at a model-like size,
    #: ``small_bench(rnd, n_tokens, dim, mlp_hidden, (batch, seq, heads, head_dim))``
    small_bench: Callable[..., list[Any]] | None = None

    def function(self, name: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), name)


# --- the registry ----------------------------------------------------------------------------------

OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec(
        "rms_norm", "hydra_kernels.ops.rms_norm", "RMSNorm",
        ("rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref"),
        "FUSED_RMS_NORM", "FUSED_RMS_NORM_BWD",
        checks=(
            Check("rms_norm", "rms_norm", "rms_norm_ref", _check_rms,
                  ((3, 7, 50),), ((3, 333, 1000), (77, 4100))),
            Check("fused_add_rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_ref", _check_add_rms,
                  ((3, 7, 50),), ((3, 333, 1000),), half_reduction="max"),
        ),
        bench={"rms_norm": _bench_rms, "fused_add_rms_norm": _bench_add_rms},
        small_bench=lambda rnd, n, dim, h, s4: [rnd(n, dim), rnd(dim)],
    ),
    OpSpec(
        "swiglu", "hydra_kernels.ops.swiglu", "SwiGLU", ("swiglu", "swiglu_packed", "swiglu_ref"),
        "FUSED_SWIGLU", "FUSED_SWIGLU_BWD",
        checks=(
            Check("swiglu", "swiglu", "swiglu_ref", _check_swiglu,
                  ((3, 7, 50),), ((3, 333, 1000), (999, 5443))),
            Check("swiglu_packed", "swiglu_packed", "_swiglu_packed_ref", _check_swiglu_packed,
                  ((3, 7, 50),), ((3, 333, 1000),)),
        ),
        bench={"swiglu": _bench_swiglu},
        sweep=tuple(
            {"block_q": b, "num_warps": w}
            for b in (1024, 2048, 4096, 8192)
            for w in (4, 8, 16)
            if w * 128 <= b  # the launcher caps warps at block/128
        ),
        sweep_table="LAUNCH_DEFAULTS",
        small_bench=lambda rnd, n, dim, h, s4: [rnd(n, h), rnd(n, h)],
    ),
    OpSpec(
        "qk_norm", "hydra_kernels.ops.qk_norm", "QK-Norm", ("qk_norm", "qk_norm_ref"),
        "FUSED_QK_NORM", "FUSED_QK_NORM_BWD",
        checks=(
            Check("qk_norm", "qk_norm", "qk_norm_ref", _check_qk_norm, ((2, 5, 3, 24),),
                  ((3, 67, 6, 64), (2, 33, 5, 100))),
        ),
        bench={"qk_norm": _bench_qk_norm},
        small_bench=_small_qk_norm,
    ),
    OpSpec(
        "rope", "hydra_kernels.ops.rope", "RoPE", ("rope", "rope_ref"), "FUSED_ROPE", None,
        checks=(
            Check("rope", "rope", "rope_ref", _check_rope, ((2, 5, 3, 24, 16),),
                  ((3, 67, 6, 64, 32), (2, 34, 5, 100, 100))),
        ),
        bench={"rope": _bench_rope},
        sweep=tuple({"block_rows": r, "num_warps": w} for r in (8, 16, 32, 64) for w in (2, 4, 8)),
        sweep_table="LAUNCH_DEFAULTS",
        small_bench=_small_rope,
    ),
    OpSpec(
        "qk_norm_rope", "hydra_kernels.ops.qk_norm_rope", "QK-Norm+RoPE",
        ("qk_norm_rope", "qk_norm_rope_ref"), "FUSED_QK_NORM_ROPE", "FUSED_QK_NORM_ROPE_BWD",
        checks=(
            Check("qk_norm_rope", "qk_norm_rope", "qk_norm_rope_ref", _check_qk_norm_rope,
                  ((2, 5, 3, 24, 16),), ((3, 67, 6, 64, 64), (2, 34, 5, 100, 50)), half_reduction="max"),
        ),
        bench={"qk_norm_rope": _bench_qk_norm_rope},
        small_bench=_small_qk_norm_rope,
    ),
    OpSpec(
        "linear_cross_entropy", "hydra_kernels.ops.linear_cross_entropy", "Linear+CE",
        ("linear_cross_entropy", "linear_cross_entropy_ref", "LinearCEOptions", "linear_ce_options",
         "reset_linear_ce_options", "set_linear_ce_options"),
        "FUSED_LINEAR_CE", None,
        checks=(
            Check("linear_cross_entropy", "linear_cross_entropy", "linear_cross_entropy_ref",
                  _check_linear_ce, ((13, 24, 97),), ((333, 160, 5003),), grad_atol=_linear_ce_grad_atol,
                  repeatable=False),
        ),
        bench={"linear_cross_entropy": _bench_linear_ce},
        small_bench=_small_linear_ce,
    ),
    OpSpec(
        "ccgqa_conv", "hydra_kernels.ops.ccgqa_conv", "CCGQA conv", ("ccgqa_conv", "ccgqa_conv_ref"),
        "FUSED_CCGQA_CONV", "FUSED_CCGQA_CONV_BWD",
        checks=(
            Check("ccgqa_conv", "ccgqa_conv", "ccgqa_conv_ref", _check_ccgqa_conv, ((2, 9, 2, 3, 16),),
                  ((3, 300, 4, 3, 64), (2, 77, 3, 2, 32)), half_reduction="max"),
            Check("ccgqa_conv_zero_context", "ccgqa_conv", "ccgqa_conv_ref", _check_ccgqa_conv_zero_context,
                  ((2, 9, 2, 3, 16),), ((3, 300, 4, 3, 64),), half_reduction="max"),
            Check("ccgqa_conv_qk_mean", "ccgqa_conv", "ccgqa_conv_ref", _check_ccgqa_conv_qk_mean,
                  ((2, 9, 4, 3, 16),), ((3, 300, 16, 3, 64),), half_reduction="max"),
        ),
        bench={"ccgqa_conv": _bench_ccgqa_conv},
        small_bench=lambda rnd, n, dim, h, s4: [rnd(s4[0], s4[1] + 2, s4[2] * s4[3]),
                                                 rnd(s4[2], 3, s4[3], s4[3]), rnd(s4[2] * s4[3])],
    ),
)  # fmt: skip

#: The ops by name, in the order status tables list them.
OPS_BY_NAME: dict[str, OpSpec] = {s.name: s for s in OP_SPECS}

#: Other spellings ``check --op`` and ``bench --op`` take: ``bench`` named linear+CE ``linear_ce``
#: while ``check`` (and the function) said ``linear_cross_entropy``; the old spelling keeps working.
OP_ALIASES: dict[str, str] = {"linear_ce": "linear_cross_entropy"}


def canonical_op(name: str) -> str:
    """``name`` under its canonical spelling (an alias of :data:`OP_ALIASES` resolved)."""
    return OP_ALIASES.get(name, name)
