"""The benchmark workloads of the registered ops: each :class:`~hydra_kernels.registry.OpSpec`'s
``bench`` generators (``hydra-kernels bench`` and :mod:`hydra_kernels.bench`) and its
``small_bench`` inputs at a model-like size (:func:`hydra_kernels.benchmark_kernels`).

Separate from :mod:`hydra_kernels.registry`, which holds the entries that name these functions,
so that the registry reads as the list of ops. Like the registry, this module imports nothing of
hydra_kernels at module level (it is read while the ops' modules import
:mod:`hydra_kernels.controls`); the bench and op modules are imported inside the generators.
"""

from __future__ import annotations

import math

import torch


def _rand(*shape: int, dev, dt, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=dt).requires_grad_(grad)


# --- rms_norm ------------------------------------------------------------------------------------


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


# --- swiglu --------------------------------------------------------------------------------------


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


# --- qk_norm and rope: [B, S, H, D] of q/k in the presets ----------------------------------------


PRESET_HEAD_SHAPES = ((8, 2048, 6, 64), (8, 2048, 16, 128))


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


def _bench_qk_norm_rope(dev, dt, liger, why):
    return _qk_norm_workloads(dev, dt, why, rotate=True)


# --- linear_cross_entropy ------------------------------------------------------------------------


def _bench_linear_ce(dev, dt, liger, why):
    from hydra_kernels.bench import LINEAR_CE_MODES, TOKENS, Workload, with_dw_accum
    from hydra_kernels.bench_harness import peers
    from hydra_kernels.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

    n = TOKENS
    for d, v in ((768, 50304), (2048, 128256)):
        # "linear_ce": the key of Liger's op in bench_harness.liger_peers (hydra-diag reads it too)
        impls, notes = peers("linear_ce", linear_cross_entropy_ref, liger, why)
        impls["hydra"] = linear_cross_entropy
        for mode in LINEAR_CE_MODES:  # the other dW schemes: the memory/precision trade-off
            impls[f"hydra {mode}"] = with_dw_accum(mode)
        hid = _rand(n, d, dev=dev, dt=dt)
        w = (torch.randn(v, d, device=dev, dtype=dt) * 0.02).requires_grad_()
        y = torch.randint(0, v, (n,), device=dev)
        yield Workload(
            "linear_cross_entropy", f"{n}x{d} V={v}", [hid, w, y], None, impls, notes,
            flops=6.0 * n * d * v, measure_memory=True,
        )  # fmt: skip


# --- model-like inputs for benchmark_kernels -----------------------------------------------------


def _small_qk_norm(rnd, n, dim, hidden, shape4):
    return [rnd(*shape4), math.sqrt(shape4[-1]), rnd(shape4[2], dt=torch.float32)]


def _small_rope(rnd, n, dim, hidden, shape4):
    seq, half = shape4[1], shape4[3] // 2
    angles = torch.rand(seq, half, device=rnd(1).device) * seq
    return [rnd(*shape4), angles.cos(), angles.sin()]


def _small_qk_norm_rope(rnd, n, dim, hidden, shape4):
    seq, quarter = shape4[1], shape4[3] // 4  # RoPE on half of each head, as CCGQA's
    angles = torch.rand(seq, quarter, device=rnd(1).device) * seq
    return [*_small_qk_norm(rnd, n, dim, hidden, shape4), angles.cos(), angles.sin()]


def _small_linear_ce(rnd, n, dim, hidden, shape4):
    vocab, like = 32000, rnd(1)
    weight = (torch.randn(vocab, dim, device=like.device, dtype=like.dtype) * 0.02).requires_grad_()
    return [rnd(n, dim), weight, torch.randint(0, vocab, (n,), device=like.device)]


# --- ccgqa_conv ----------------------------------------------------------------------------------


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
