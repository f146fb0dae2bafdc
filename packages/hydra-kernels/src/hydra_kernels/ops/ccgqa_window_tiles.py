"""CCGQA's conv weights folded straight into a decode window's non-zero tiles, for many modules in
one kernel (no autograd).

What it builds: CCGQA (hydra_model/ccgqa.py) runs a depthwise conv along the sequence (taps
``seq_w`` [C, 1, k_seq], bias ``seq_b`` [C]), then a head-wise grouped conv (``ch_w`` [C, d, k_ch],
``ch_b`` [C], C/d groups), then adds the q-k mean (``mean`` [C, C]) of the newest token. All of it
is linear in the window of the last K = k_seq + k_ch − 1 tokens' inputs, so it is one weight
W [C, K·C] over window column s·C + c (input channel c at window offset s; s = K−1 is the newest
token) plus a bias [C]. For output row r of head g = r // d and input c = g'·d + i:

    W[r, s·C + c] = [g == g'] · Σ_a ch_w[r, i, a] · seq_w[c, 0, s − a]  +  [s == K−1] · mean[r, c]
    bias[r]       = ch_b[r] + Σ_i (Σ_a ch_w[r, i, a]) · seq_b[g·d + i]

(a over the grouped conv's taps, s − a within [0, k_seq)). A decode step multiplies its window by W
as non-zero tiles (:mod:`hydra_kernels.ops.tile_linear`): at the 100M preset 72 of W's 768 tiles.

Why a kernel: a generation builds W once per new cache, for every CCGQA module of the model. Op by
op (hydra_model/ccgqa_fold.py) that is about twenty launches and 250 MB of temporaries at the 100M
preset (the dense W of all twelve modules, then its tiles cut out), in a prefill bound by its host
launches. Here it is one launch writing only the kept tiles: each program computes one tile of one
module, reading that module's parameters through a table of their addresses (no stacked copies),
and the programs of a block row's first tile also write that row block's bias.

Arithmetic: every sum in fp32 (fp64 references in fp64), rounded once to the parameters' dtype;
the op-by-op fold rounds each product and partial sum to that dtype instead, so the two may differ
in the last bit of a 16-bit weight.

Faces: the PyTorch reference :func:`ccgqa_window_tiles_ref`, the Triton kernel
``_window_tiles_kernel`` with its launcher :func:`ccgqa_window_tiles_launch`, and
:func:`ccgqa_window_tiles`, which runs the kernel where hydra_kernels' Triton path is on for the
parameters' device (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    device_guard,
    next_power_of_2,
    run_with_fallback,
    to_output_dtype,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache
from hydra_kernels.ops.tile_linear import TileLayout, pack_tiles_many

#: One module's parameters: (seq_w [C, 1, k_seq], seq_b [C], ch_w [C, d, k_ch], ch_b [C], mean [C, C]).
ConvParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _shapes(params: Sequence[ConvParams]) -> tuple[int, int, int, int]:
    """(C, d, k_seq, k_ch), after checking every module's parameters against the first's."""
    if not params:
        raise ValueError("ccgqa_window_tiles: no modules")
    seq_w, _, ch_w, _, _ = params[0]
    if ch_w.dim() != 3 or seq_w.dim() != 3 or seq_w.shape[1] != 1:
        raise ValueError(f"ccgqa_window_tiles: seq_w [C, 1, k_seq] and ch_w [C, d, k_ch]; got "
                         f"{tuple(seq_w.shape)}, {tuple(ch_w.shape)}")  # fmt: skip
    c, d, k_ch = ch_w.shape
    k_seq = seq_w.shape[2]
    want = ((c, 1, k_seq), (c,), (c, d, k_ch), (c,), (c, c))
    for m, module in enumerate(params):
        if len(module) != 5 or any(tuple(t.shape) != s for t, s in zip(module, want, strict=True)):
            got = [tuple(t.shape) for t in module]
            raise ValueError(f"ccgqa_window_tiles: module {m}'s parameters are {got}, expected {list(want)}")
    if c % d or seq_w.shape[0] != c:
        raise ValueError(f"ccgqa_window_tiles: C = {c} channels in heads of d = {d}")
    return c, d, k_seq, k_ch


# --- PyTorch reference ---------------------------------------------------------------------------


def ccgqa_window_tiles_ref(
    params: Sequence[ConvParams], index: torch.Tensor, block_n: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles [L, NB, NNZ, block_n, block_k], bias [L, C]) in the first weight's dtype for the L
    modules' ``params``: the dense window weight W of the module docstring, computed in fp32 (fp64
    for fp64), then its tiles at ``index`` [NB, NNZ] (block columns; −1 marks padding: zeros)."""
    c, d, k_seq, k_ch = _shapes(params)
    dtype = params[0][0].dtype
    ct = torch.promote_types(dtype, torch.float32)
    seq_w, seq_b, ch_w, ch_b, mean = (torch.stack([p[j] for p in params]).to(ct) for j in range(5))
    count, heads, k_total = len(params), c // d, k_seq + k_ch - 1
    w_ch = ch_w.view(count, heads, d, d, k_ch)  # [L, g, o, i, a]
    w_seq = seq_w.view(count, heads, d, k_seq)  # [L, g, i, b]
    # [L, g, o, s, g', i]: output channel (g, o), window offset s, input channel (g', i)
    dense = torch.zeros(count, heads, d, k_total, heads, d, dtype=ct, device=ch_w.device)
    for a in range(k_ch):
        for b in range(k_seq):
            for g in range(heads):
                dense[:, g, :, a + b, g, :] += w_ch[:, g, :, :, a] * w_seq[:, g, None, :, b]
    dense = dense.view(count, c, k_total, c)
    dense[:, :, k_total - 1, :] += mean
    weight = dense.view(count, c, k_total * c)  # columns s·C + c
    bias = ch_b + (w_ch.sum(-1) * seq_b.view(count, heads, 1, d)).sum(-1).view(count, c)
    keep = index.to(weight.device)
    layout = TileLayout(keep.long().clamp(min=0), keep >= 0, keep)  # padding repeats column 0, zeroed
    tiles = torch.stack([t.tiles for t in pack_tiles_many(weight, block_n, block_k, layout)])
    return tiles.to(dtype), bias.to(dtype)


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _window_tiles_kernel(
    TABLE, INDEX, TILES, BIAS, n_modules,
    C: tl.constexpr, D: tl.constexpr, K_SEQ: tl.constexpr, K_CH: tl.constexpr, NNZ: tl.constexpr,
    N_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)  # block row · NNZ + slot
    mod = tl.program_id(1)
    dtype = TILES.dtype.element_ty
    # the module's parameters by address: TABLE [5, n_modules] (seq_w, seq_b, ch_w, ch_b, mean)
    seq_w = tl.load(TABLE + mod).to(tl.pointer_type(dtype))
    seq_b = tl.load(TABLE + n_modules + mod).to(tl.pointer_type(dtype))
    ch_w = tl.load(TABLE + 2 * n_modules + mod).to(tl.pointer_type(dtype))
    ch_b = tl.load(TABLE + 3 * n_modules + mod).to(tl.pointer_type(dtype))
    mean = tl.load(TABLE + 4 * n_modules + mod).to(tl.pointer_type(dtype))
    k_total: tl.constexpr = K_SEQ + K_CH - 1

    rows = (tile // NNZ) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels r
    column_block = tl.load(INDEX + tile)  # −1: a padding tile (zeros)
    cols = column_block * BLOCK_K + tl.arange(0, BLOCK_K)  # window columns s·C + c
    r = rows[:, None]
    s = cols[None, :] // C
    c = cols[None, :] % C
    inside = (r < C) & (cols[None, :] < k_total * C) & (column_block >= 0)
    same_head = inside & ((r // D) == (c // D))
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for a in tl.static_range(K_CH):  # grouped-conv tap a reads the depthwise tap s − a
        ok = same_head & (s - a >= 0) & (s - a < K_SEQ)
        w_ch = tl.load(ch_w + r * (D * K_CH) + (c % D) * K_CH + a, mask=ok, other=0.0)
        w_seq = tl.load(seq_w + c * K_SEQ + (s - a), mask=ok, other=0.0)
        acc += w_ch.to(tl.float32) * w_seq.to(tl.float32)
    newest = inside & (s == k_total - 1)
    acc += tl.load(mean + r * C + c, mask=newest, other=0.0).to(tl.float32)
    out = TILES + (mod * N_TILES + tile).to(tl.int64) * (BLOCK_N * BLOCK_K)
    out += tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out, to_output_dtype(acc, dtype))

    if tile % NNZ == 0:  # one program a block row writes the block row's bias
        i = tl.arange(0, BLOCK_D)[None, :]
        m = (r < C) & (i < D)
        taps = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        for a in tl.static_range(K_CH):
            taps += tl.load(ch_w + r * (D * K_CH) + i * K_CH + a, mask=m, other=0.0).to(tl.float32)
        carried = tl.load(seq_b + (r // D) * D + i, mask=m, other=0.0).to(tl.float32)
        bias = tl.sum(taps * carried, axis=1) + tl.load(ch_b + rows, mask=rows < C, other=0.0).to(tl.float32)
        tl.store(BIAS + mod * C + rows, to_output_dtype(bias, dtype), mask=rows < C)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()
#: the parameters' addresses → their table on the device (the addresses, not the values: a
#: module whose parameters are the same tensors gets the same table; changed values are read anew)
_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_TABLES = 8


def _address_table(params: Sequence[ConvParams], device: torch.device) -> torch.Tensor:
    """[5, L] int64 on ``device``: the five parameters' addresses of each module. Made once per set
    of addresses (a copy from the host, which the CUDA runtime orders after the stream's earlier
    work), then kept."""
    addresses = tuple(params[m][j].data_ptr() for j in range(5) for m in range(len(params)))
    key = (addresses, device)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        table = torch.tensor(addresses, dtype=torch.int64).view(5, len(params)).to(device)
        _TABLES[key] = table
    return table


def ccgqa_window_tiles_launch(
    params: Sequence[ConvParams], index: torch.Tensor, block_n: int, block_k: int, shapes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (arguments as :func:`ccgqa_window_tiles`, which checked them and copied
    any non-contiguous parameter; ``shapes`` its (C, d, k_seq, k_ch)); every parameter
    contiguous, in one dtype on one device (else a ValueError: the public function only passes
    such)."""
    c, d, k_seq, k_ch = shapes
    first = params[0][0]
    dtype, device = first.dtype, first.device
    for m, module in enumerate(params):
        for t in module:
            if t.dtype != dtype or t.device != device or not t.is_contiguous():
                layout = "contiguous" if t.is_contiguous() else "non-contiguous"
                raise ValueError(f"ccgqa_window_tiles: module {m}'s parameters must be contiguous "
                                 f"{dtype} on {device}; got a {layout} {t.dtype} on {t.device}")  # fmt: skip
    index = index.contiguous()
    nb, nnz = index.shape
    count = len(params)
    tiles = torch.empty(count, nb, nnz, block_n, block_k, dtype=dtype, device=device)
    bias = torch.empty(count, c, dtype=dtype, device=device)
    table = _address_table(params, device)
    key = (count, c, d, k_seq, k_ch, nb, nnz, block_n, block_k, dtype, first.get_device())
    plan = _PLANS.get(key)
    if plan is None:
        consts = {"C": c, "D": d, "K_SEQ": k_seq, "K_CH": k_ch, "NNZ": nnz, "N_TILES": nb * nnz,
                  "BLOCK_N": block_n, "BLOCK_K": block_k, "BLOCK_D": next_power_of_2(d)}  # fmt: skip
        grid = (nb * nnz, count)
        plan = _PLANS[key] = LaunchPlan(_window_tiles_kernel, grid, consts, 4, 1, first.get_device())
    with device_guard(first):
        plan(table, index, tiles, bias, count)
    return tiles, bias


#: a module's parameters in ConvParams order, for error messages
_PARAM_NAMES = ("seq_w", "seq_b", "ch_w", "ch_b", "mean")


def _check_devices(params: Sequence[ConvParams]) -> None:
    """A ValueError naming the first parameter off module 0's ``seq_w``'s device: the kernel reads
    every module's parameters there (a launcher refusal became a counted fallback, and the
    reference's torch.stack failed naming none)."""
    device = params[0][0].device
    for m, module in enumerate(params):
        for name, t in zip(_PARAM_NAMES, module, strict=True):
            if t.device != device:
                raise ValueError(
                    f"ccgqa_window_tiles: module {m}'s {name} {tuple(t.shape)} {t.dtype} is on {t.device} "
                    f"but module 0's seq_w is on {device}; pass every module's parameters on one device"
                )


def _contiguous(params: Sequence[ConvParams]) -> list[ConvParams]:
    """``params`` with each non-contiguous parameter copied (the kernel reads them at fixed
    strides). A module's parameters need not be contiguous (a load with ``assign=True`` keeps a
    checkpoint's strides: hydra_model/persistence.py); the copies are small (the largest is the
    [C, C] q-k mean) beside the tiles built from them, once per cache."""
    return [m if all(t.is_contiguous() for t in m) else tuple(t.contiguous() for t in m) for m in params]


def _check_index(index: torch.Tensor, c: int, block_n: int, device: torch.device) -> None:
    """A caller's index that no path can use (ValueError on every path, not a kernel fallback)."""
    if index.dtype != torch.int32 or index.dim() != 2 or index.device != device:
        raise ValueError(f"ccgqa_window_tiles: index must be [NB, NNZ] int32 on {device}; got "
                         f"{index.dtype} {list(index.shape)} on {index.device}")  # fmt: skip
    if index.shape[0] != -(-c // block_n):
        raise ValueError(f"ccgqa_window_tiles: index has {index.shape[0]} block rows; C = {c} with "
                         f"block_n = {block_n} needs {-(-c // block_n)}")  # fmt: skip


# --- public function -----------------------------------------------------------------------------


def kernel_path(weight: torch.Tensor) -> bool:
    """Whether :func:`ccgqa_window_tiles` runs its kernel for parameters like ``weight`` (its
    dtype and device, the op's switch; parameters of mixed dtypes aside); elsewhere it runs the
    reference."""
    return weight.dtype in KERNEL_DTYPES and controls.triton_path("ccgqa_window_tiles", weight)


def ccgqa_window_tiles(
    params: Sequence[ConvParams], index: torch.Tensor, block_n: int = 64, block_k: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window weights of L CCGQA modules as their tiles at ``index`` (the module docstring):
    ``params`` one (seq_w [C, 1, k_seq], seq_b [C], ch_w [C, d, k_ch], ch_b [C], mean [C, C]) per
    module, all of one shape; ``index`` [NB, NNZ] int32 (hydra_kernels.ops.tile_linear's
    ``TileLayout.index``: each kept tile's block column, −1 for padding). → (tiles [L, NB, NNZ,
    block_n, block_k], bias [L, C]) in the first parameter's dtype. Parameters of any strides,
    all on one device (else a ValueError naming the first that is not). The kernel runs where
    hydra_kernels' Triton path is on for their device; fp64, parameters of mixed dtypes (the
    kernel reads one), a switched-off path or another device run :func:`ccgqa_window_tiles_ref`.
    No autograd: the parameters' gradients are not tracked."""
    shapes = _shapes(params)
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"ccgqa_window_tiles: {name}={size} must be a power of two")
    first = params[0][0]
    _check_index(index, shapes[0], block_n, first.device)
    _check_devices(params)
    if not kernel_path(first) or any(t.dtype != first.dtype for module in params for t in module):
        return ccgqa_window_tiles_ref(params, index, block_n, block_k)
    params = _contiguous(params)
    with torch.no_grad():
        return run_with_fallback(
            "ccgqa_window_tiles",
            lambda: ccgqa_window_tiles_launch(params, index, block_n, block_k, shapes),
            lambda: ccgqa_window_tiles_ref(params, index, block_n, block_k),
        )
