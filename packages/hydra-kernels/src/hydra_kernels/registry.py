"""The ops of hydra_kernels, one entry each: everything the package's tooling needs to know.

A new kernel op is its module (``ops/<op>.py``: kernels, launcher, autograd Function or
``torch.library`` op, and the ``<op>_ref`` reference), ONE :class:`OpSpec` in :data:`OP_SPECS`
below, and its test (``tests/hydra_kernels/test_<op>.py``). From the entry: the op's switch and
environment variables (:mod:`hydra_kernels.controls`), the names ``hydra_kernels`` exports, the
numerical checks of ``hydra-kernels check`` (:mod:`hydra_kernels.checks`), the workloads of
``hydra-kernels bench`` and :func:`hydra_kernels.benchmark_kernels` (:mod:`hydra_kernels.bench`)
and the launch tables ``hydra-kernels status`` shows (:mod:`hydra_kernels.cli`).

Functions are named, not imported: this module is read while the ops' own modules import
:mod:`hydra_kernels.controls`, so it imports nothing of hydra_kernels at module level.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _rand(*shape: int, dev, dt, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=dt).requires_grad_(grad)


# --- rms_norm ----------------------------------------------------------------------------------


def _check_rms(shape, gen):
    return [_randn(gen, *shape), 1 + 0.3 * _randn(gen, shape[-1]), 1e-6], [0, 1]


def _check_add_rms(shape, gen):
    return [_randn(gen, *shape), _randn(gen, *shape), 1 + 0.3 * _randn(gen, shape[-1]), 1e-6], [0, 1, 2]


def _bench_rms(dev, dt, liger, why):
    from hydra_kernels.bench import TOKENS, Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.rms_norm import rms_norm, rms_norm_ref

    es, n = torch.empty((), dtype=dt).element_size(), TOKENS
    for d in (768, 2048, 4096):
        impls, notes = peers("rms_norm", rms_norm_ref, liger, why)
        impls["hydra"] = rms_norm
        x, w = _rand(n, d, dev=dev, dt=dt), _rand(d, dev=dev, dt=dt)
        yield Workload("rms_norm", f"{n}x{d}", [x, w], torch.randn_like(x), impls, notes, 5 * n * d * es)


def _bench_add_rms(dev, dt, liger, why):
    from hydra_kernels.bench import TOKENS, Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref

    es, n = torch.empty((), dtype=dt).element_size(), TOKENS
    for d in (768, 2048, 4096):
        impls, notes = peers("fused_add_rms_norm", fused_add_rms_norm_ref, liger, why)
        impls["hydra"] = fused_add_rms_norm
        x, r, w = _rand(n, d, dev=dev, dt=dt), _rand(n, d, dev=dev, dt=dt), _rand(d, dev=dev, dt=dt)
        grads = (torch.randn_like(x), torch.randn_like(x))
        # fwd reads x, r and writes normed, summed; bwd reads both upstream grads and summed and
        # writes dx (the residual's gradient is the same values: counted once)
        yield Workload("fused_add_rms_norm", f"{n}x{d}", [x, r, w], grads, impls, notes, 8 * n * d * es)


# --- swiglu ------------------------------------------------------------------------------------


def _check_swiglu(shape, gen):
    return [2 * _randn(gen, *shape), _randn(gen, *shape)], [0, 1]


def _check_swiglu_packed(shape, gen):
    return [2 * _randn(gen, *shape[:-1], 2 * shape[-1])], [0]


def _bench_swiglu(dev, dt, liger, why):
    from hydra_kernels.bench import TOKENS, Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops import swiglu as mod

    es, n = torch.empty((), dtype=dt).element_size(), TOKENS
    for d in (768, 2048, 4096):
        h = int(8 * d / 3 / 64) * 64  # the MLP widths of the presets: 2048, 5440, 10880
        impls, notes = peers("swiglu", mod.swiglu_ref, liger, why)
        impls["hydra"] = mod.swiglu
        a, b = _rand(n, h, dev=dev, dt=dt), _rand(n, h, dev=dev, dt=dt)
        yield Workload("swiglu", f"{n}x{h}", [a, b], torch.randn_like(a), impls, notes, 7 * n * h * es)
    h = 5440  # the MLP's layout: both halves of one [N, 2H] projection

    def split_ref(gu: torch.Tensor) -> torch.Tensor:
        return mod.swiglu_ref(gu[:, :h], gu[:, h:])

    impls, notes = peers("swiglu", split_ref, {}, why)
    impls["hydra"] = mod.swiglu_packed
    if "swiglu" in liger:
        impls["liger"] = lambda gu: liger["swiglu"](gu[:, :h], gu[:, h:])
    gu = _rand(n, 2 * h, dev=dev, dt=dt)
    g = torch.randn(n, h, device=dev, dtype=dt)
    yield Workload("swiglu", f"{n}x{h} packed", [gu], g, impls, notes, 7 * n * h * es)


# --- qk_norm and rope: [B, S, H, D] of q/k in the presets --------------------------------------

PRESET_HEAD_SHAPES = ((8, 2048, 6, 64), (8, 2048, 16, 128))


def _check_qk_norm(shape, gen):
    return [_randn(gen, *shape), 0.7 * shape[-1] ** 0.5, 0.2 * _randn(gen, shape[-2])], [0, 2]


def _qk_norm_workloads(dev, dt, why, rotate: bool):
    """qk_norm's workloads at the presets' q/k shapes; ``rotate``: qk_norm_rope's (RoPE on half of
    each head, fp32 tables as a rotary cache keeps them)."""
    from hydra_kernels.bench import Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops import qk_norm, qk_norm_rope

    op, mod = ("qk_norm_rope", qk_norm_rope) if rotate else ("qk_norm", qk_norm)
    es = torch.empty((), dtype=dt).element_size()
    for bsz, seq, heads, d in PRESET_HEAD_SHAPES:
        impls, notes = peers(op, getattr(mod, f"{op}_ref"), {}, why)
        impls["hydra"] = getattr(mod, op)
        notes.setdefault("liger", "Liger-Kernel has no per-head L2 norm with temperature")
        x = _rand(bsz, seq, heads, d, dev=dev, dt=dt)
        args = [x, math.sqrt(d), _rand(heads, dev=dev, dt=torch.float32)]
        if rotate:
            angles = torch.rand(seq, d // 4, device=dev) * seq
            args += [angles.cos(), angles.sin()]
        shape = f"{bsz}x{seq}x{heads}x{d}"
        yield Workload(op, shape, args, torch.randn_like(x), impls, notes, 5 * x.numel() * es)


def _bench_qk_norm(dev, dt, liger, why):
    return _qk_norm_workloads(dev, dt, why, rotate=False)


def _check_rope(shape, gen):
    # shape = (B, S, H, D, R): per-sequence tables when B > 1 and S is odd, shared otherwise
    b, s, h, d, r = shape
    table = (b, s, r // 2) if s % 2 else (s, r // 2)
    angles = 3 * _randn(gen, *table)
    return [_randn(gen, b, s, h, d), angles.cos(), angles.sin()], [0]


def _bench_rope(dev, dt, liger, why):
    from hydra_kernels.bench import Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.rope import rope, rope_ref

    es = torch.empty((), dtype=dt).element_size()
    for bsz, seq, heads, d in PRESET_HEAD_SHAPES:
        for rot in (d // 2, d):
            impls, notes = peers("rope", rope_ref, {}, why)
            impls["hydra"] = rope
            notes["liger"] = "Liger's rope rotates q and k together in [B, H, S, D], full width"
            x = _rand(bsz, seq, heads, d, dev=dev, dt=dt)
            angles = torch.rand(seq, rot // 2, device=dev) * seq
            cos, sin = angles.cos(), angles.sin()  # fp32 tables, as a rotary cache keeps them
            floor = 4 * x.numel() * es + 4 * cos.numel() * cos.element_size()
            shape = f"{bsz}x{seq}x{heads}x{d} R={rot}"
            yield Workload("rope", shape, [x, cos, sin], torch.randn_like(x), impls, notes, floor)


def _check_qk_norm_rope(shape, gen):
    # shape = (B, S, H, D, R): qk_norm's inputs, then rope's tables (per-sequence when S is odd)
    norm_args, grads = _check_qk_norm(shape[:4], gen)
    (_, cos, sin), _ = _check_rope(shape, gen)
    return [*norm_args, cos, sin], grads


def _bench_qk_norm_rope(dev, dt, liger, why):
    return _qk_norm_workloads(dev, dt, why, rotate=True)


def _small_qk_norm_rope(rnd, n, dim, hidden, shape4):
    seq, quarter = shape4[1], shape4[3] // 4  # RoPE on half of each head, as CCGQA's
    angles = torch.rand(seq, quarter, device=rnd(1).device) * seq
    return [*_small_qk_norm(rnd, n, dim, hidden, shape4), angles.cos(), angles.sin()]


# --- linear_cross_entropy ------------------------------------------------------------------------


def _check_linear_ce(shape, gen):
    n, d, v = shape
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < 0.2] = -100  # some ignored tokens
    return [_randn(gen, n, d), 0.2 * _randn(gen, v, d), targets, -100, "mean", 1e-3], [0, 1]


def _linear_ce_grad_atol(args, dtype, gos):
    from hydra_kernels.ops.linear_cross_entropy import grad_rounding_atol

    return grad_rounding_atol(*args[:3], dtype, *args[3:6], gos[0])


def _bench_linear_ce(dev, dt, liger, why):
    from hydra_kernels.bench import LINEAR_CE_MODES, TOKENS, Workload, with_dw_accum
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

    n = TOKENS
    for d, v in ((768, 50304), (2048, 128256)):
        impls, notes = peers("linear_ce", linear_cross_entropy_ref, liger, why)
        impls["hydra"] = linear_cross_entropy
        for mode in LINEAR_CE_MODES:  # the other dW schemes: the memory/precision trade-off
            impls[f"hydra {mode}"] = with_dw_accum(mode)
        hid = _rand(n, d, dev=dev, dt=dt)
        w = (torch.randn(v, d, device=dev, dtype=dt) * 0.02).requires_grad_()
        y = torch.randint(0, v, (n,), device=dev)
        yield Workload(
            "linear_ce", f"{n}x{d} V={v}", [hid, w, y], None, impls, notes,
            flops=6.0 * n * d * v, measure_memory=True,
        )  # fmt: skip


# --- model-like inputs for benchmark_kernels ------------------------------------------------------


def _small_qk_norm(rnd, n, dim, hidden, shape4):
    return [rnd(*shape4), math.sqrt(shape4[-1]), rnd(shape4[2], dt=torch.float32)]


def _small_rope(rnd, n, dim, hidden, shape4):
    seq, half = shape4[1], shape4[3] // 2
    angles = torch.rand(seq, half, device=rnd(1).device) * seq
    return [rnd(*shape4), angles.cos(), angles.sin()]


def _small_linear_ce(rnd, n, dim, hidden, shape4):
    vocab, like = 32000, rnd(1)
    weight = (torch.randn(vocab, dim, device=like.device, dtype=like.dtype) * 0.02).requires_grad_()
    return [rnd(n, dim), weight, torch.randint(0, vocab, (n,), device=like.device)]


# --- ccgqa_conv ---------------------------------------------------------------------------------


def _check_ccgqa_conv(shape, gen):
    b, n, g, k, d = shape  # window [B, n + K - 1, G·d], weight [G, K, d, d], bias [G·d]
    weight = _randn(gen, g, k, d, d) / math.sqrt(d * k)
    return [_randn(gen, b, n + k - 1, g * d), weight, 0.1 * _randn(gen, g * d)], [0, 1, 2]


def _check_ccgqa_conv_zero_context(shape, gen):
    b, n, g, k, d = shape  # x [B, n, G·d] with K - 1 zero rows implied in front (zero_context)
    args, grads = _check_ccgqa_conv((b, n - k + 1, g, k, d), gen)
    return [args[0][:, k - 1 :].contiguous(), *args[1:], True], grads


def _check_ccgqa_conv_qk_mean(shape, gen):
    # u in place, CCGQA's q-k mean on: 3/4 of the heads queries, 3 of them a key head
    args, grads = _check_ccgqa_conv_zero_context(shape, gen)
    return [*args, 3 * shape[2] // 4], grads


#: (B, n, heads, taps, head dim): the 100M preset's CCGQA (12 + 4 heads of 64, K = 3) and the
#: 2026-11-23 preset's (4 + 2 heads)
CCGQA_CONV_SHAPES = ((8, 2048, 16, 3, 64), (8, 2048, 6, 3, 64))


def _bench_ccgqa_conv(dev, dt, liger, why):
    from hydra_kernels.bench import Workload
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.ccgqa_conv import ccgqa_conv, ccgqa_conv_ref

    es = torch.empty((), dtype=dt).element_size()
    for b, n, g, k, d in CCGQA_CONV_SHAPES:
        impls, notes = peers("ccgqa_conv", ccgqa_conv_ref, {}, why)
        impls["hydra"] = ccgqa_conv
        notes.setdefault("liger", "Liger-Kernel has no CCGQA conv")
        window = _rand(b, n + k - 1, g * d, dev=dev, dt=dt)
        weight = _rand(g, k, d, d, dev=dev, dt=torch.float32)
        bias = _rand(g * d, dev=dev, dt=torch.float32)
        dz = torch.randn(b, n, g, d, device=dev, dtype=dt)
        # forward reads the window, writes z; backward reads dz twice and the window, writes its grad
        floor = 6 * b * n * g * d * es
        flops = 3 * 2 * b * n * g * d * d * k  # three products of [tokens, d] x [d, d] per tap
        yield Workload("ccgqa_conv", f"{b}x{n}x{g}x{k}x{d}", [window, weight, bias], dz, impls, notes,
                       floor, flops)  # fmt: skip


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
        bench={"linear_ce": _bench_linear_ce},
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
