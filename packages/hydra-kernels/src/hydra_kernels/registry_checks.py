"""The inputs of ``hydra-kernels check`` for the registered ops: each
:class:`~hydra_kernels.registry.Check`'s ``make(shape, gen)`` (float64 CPU arguments and the
indices to differentiate) and ``grad_atol``.

Separate from :mod:`hydra_kernels.registry`, which holds the entries that name these functions,
so that the registry reads as the list of ops. Like the registry, this module imports nothing of
hydra_kernels at module level (it is read while the ops' modules import
:mod:`hydra_kernels.controls`); ``_linear_ce_grad_atol`` imports its op's function when called.
"""

from __future__ import annotations

import math

import torch


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


# --- rms_norm ------------------------------------------------------------------------------------


def _check_rms(shape, gen):
    return [_randn(gen, *shape), 1 + 0.3 * _randn(gen, shape[-1]), 1e-6], [0, 1]


def _check_add_rms(shape, gen):
    return [_randn(gen, *shape), _randn(gen, *shape), 1 + 0.3 * _randn(gen, shape[-1]), 1e-6], [0, 1, 2]


# --- swiglu --------------------------------------------------------------------------------------


def _check_swiglu(shape, gen):
    return [2 * _randn(gen, *shape), _randn(gen, *shape)], [0, 1]


def _check_swiglu_packed(shape, gen):
    return [2 * _randn(gen, *shape[:-1], 2 * shape[-1])], [0]


# --- qk_norm, rope and qk_norm_rope: [B, S, H, D] of q/k -----------------------------------------


def _check_qk_norm(shape, gen):
    return [_randn(gen, *shape), 0.7 * shape[-1] ** 0.5, 0.2 * _randn(gen, shape[-2])], [0, 2]


def _check_rope(shape, gen):
    # shape = (B, S, H, D, R): per-sequence tables when B > 1 and S is odd, shared otherwise
    b, s, h, d, r = shape
    table = (b, s, r // 2) if s % 2 else (s, r // 2)
    angles = 3 * _randn(gen, *table)
    return [_randn(gen, b, s, h, d), angles.cos(), angles.sin()], [0]


def _check_qk_norm_rope(shape, gen):
    # shape = (B, S, H, D, R): qk_norm's inputs, then rope's tables (per-sequence when S is odd)
    norm_args, grads = _check_qk_norm(shape[:4], gen)
    (_, cos, sin), _ = _check_rope(shape, gen)
    return [*norm_args, cos, sin], grads


# --- linear_cross_entropy ------------------------------------------------------------------------


def _check_linear_ce(shape, gen):
    n, d, v = shape
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < 0.2] = -100  # some ignored tokens
    return [_randn(gen, n, d), 0.2 * _randn(gen, v, d), targets, -100, "mean", 1e-3], [0, 1]


def _linear_ce_grad_atol(args, dtype, gos):
    from hydra_kernels.ops.linear_cross_entropy import grad_rounding_atol

    return grad_rounding_atol(*args[:3], dtype, *args[3:6], gos[0])


# --- ccgqa_conv ----------------------------------------------------------------------------------


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
