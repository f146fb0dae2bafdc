"""A decode step's ``x·Wᵀ + bias`` for a weight that is mostly zeros, reading only its non-zero
tiles, in one kernel.

Why: CCGQA's decode convs run as one GEMM over a token's window (hydra_model's ccgqa.py,
``decode_conv="window_gemm"``) with a [C, K·C] weight that is 94% zeros at the 100M preset (each
head's conv reads its own channels). At batch 1, cuBLAS reads all of it (6 MB) and, with the bias,
launches a split-K GEMM and a reduction: two kernels, about 7 µs a block on an H100
(packages/hydra-model/BENCHMARKS.md). The weight is fixed for a whole generation, so its non-zero
``block_n × block_k`` tiles are packed once (:func:`pack_tiles`) and each step reads only those.

    y[b, n] = Σ_k x[b, k] · W[n, k] + bias[n]        (fp32 accumulation, y in x's dtype)

(over the non-zero tiles only: an inf or NaN of x facing an all-zero tile does not reach y, where
a dense product would give NaN).

Faces: :func:`pack_tiles` (dense weight → :class:`TiledWeight`), the PyTorch reference
:func:`tile_linear_ref` (computed from the packed tiles, independently of the kernel), the Triton
kernel ``_tile_linear_kernel`` with its launcher :func:`tile_linear_launch`, and
:func:`tile_linear`, which runs the kernel where hydra_kernels' Triton path is on for x's device
(CUDA, or the CPU under ``TRITON_INTERPRET=1``) and the reference elsewhere. Nothing is read on the
host, so a call can be captured in a CUDA graph after one eager call. No autograd (decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hydra_kernels import controls
from hydra_kernels.ops._custom_op import (
    KERNEL_DTYPES,
    check_devices,
    device_guard,
    run_with_fallback,
    to_output_dtype,
)
from hydra_kernels.ops._launch import LaunchPlan, plan_cache


@dataclass
class TiledWeight:
    """A [out_features, in_features] weight as its non-zero tiles."""

    tiles: torch.Tensor  # [NB, NNZ, block_n, block_k]: block row i's non-zero tiles, zero-padded
    index: torch.Tensor  # [NB, NNZ] int32: each tile's block column, −1 for padding
    out_features: int
    in_features: int

    @property
    def block_n(self) -> int:
        return self.tiles.shape[2]

    @property
    def block_k(self) -> int:
        return self.tiles.shape[3]


def pack_tiles(weight: torch.Tensor, block_n: int = 64, block_k: int = 64) -> TiledWeight:
    """``weight`` [N, K] → its non-zero ``block_n × block_k`` tiles (edges zero-padded), each block
    row padded to the densest one's count."""
    if weight.dim() != 2:
        raise ValueError(f"pack_tiles: weight must be [N, K], got {tuple(weight.shape)}")
    return pack_tiles_many(weight.unsqueeze(0), block_n, block_k)[0]


@dataclass(frozen=True)
class TileLayout:
    """Which tiles a packing keeps: per block row, its kept block columns (non-zero first, in
    order), then padding. All [NB, NNZ]: ``order`` (int64, a padding slot repeats a column),
    ``present`` (bool, False on padding) and ``index`` (int32, −1 on padding)."""

    order: torch.Tensor
    present: torch.Tensor
    index: torch.Tensor

    def to(self, device: torch.device) -> TileLayout:
        return TileLayout(self.order.to(device), self.present.to(device), self.index.to(device))


def _blocks(weights: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """[L, N, K] → its tiles [L, NB, KB, BN, BK] (edges zero-padded; a view of the padded copy)."""
    count, n, k = weights.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    padded = F.pad(weights, (0, kb * block_k - k, 0, nb * block_n - n))
    return padded.view(count, nb, block_n, kb, block_k).transpose(2, 3)


def tile_nonzero(weights: torch.Tensor, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """[NB, KB] bool: the ``block_n × block_k`` tiles non-zero in any of ``weights`` [L, N, K]."""
    return _blocks(weights, block_n, block_k).ne(0).any(dim=(0, 3, 4))


def tile_layout(nonzero: torch.Tensor) -> TileLayout:
    """The layout of the tiles marked in ``nonzero`` [NB, KB] bool (on any device; one host read
    of the densest block row's count)."""
    if nonzero.dim() != 2 or nonzero.dtype != torch.bool:
        raise ValueError(f"tile_layout: nonzero must be [NB, KB] bool, got {tuple(nonzero.shape)} "
                         f"{nonzero.dtype}")  # fmt: skip
    nnz = max(1, int(nonzero.sum(1).max()))
    # the non-zero block columns first, in order (a stable sort of "is zero"), then padding
    order = torch.sort(nonzero.logical_not().to(torch.int8), dim=1, stable=True).indices[:, :nnz]
    present = nonzero.gather(1, order)  # [NB, NNZ]
    index = torch.where(present, order, torch.full_like(order, -1)).to(torch.int32).contiguous()
    return TileLayout(order, present, index)


def pack_tiles_many(
    weights: torch.Tensor, block_n: int = 64, block_k: int = 64, layout: TileLayout | None = None
) -> list[TiledWeight]:
    """``weights`` [L, N, K] → L packed weights sharing one tile index: the tiles non-zero in any
    of them, so that packing L weights costs the launches (and the one host read) of packing one.
    A tile zero in one weight and not in another is kept, zeros, for both: y is unchanged (the
    kernel adds exact zeros). ``layout`` (on the weights' device): the tiles to keep, known
    beforehand (every tile that may be non-zero; :func:`tile_layout`), so that nothing is read on
    the host; a tile it leaves out must be zero in every weight."""
    if weights.dim() != 3:
        raise ValueError(f"pack_tiles_many: weights must be [L, N, K], got {tuple(weights.shape)}")
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size < 1 or size & (size - 1):  # the kernel's tile loads need powers of two
            raise ValueError(f"pack_tiles: {name}={size} must be a power of two")
    count, n, k = weights.shape
    blocks = _blocks(weights, block_n, block_k)  # [L, NB, KB, BN, BK]
    nb = blocks.shape[1]
    if layout is None:
        layout = tile_layout(blocks.ne(0).any(dim=(0, 3, 4)))  # [NB, KB]
    elif layout.order.shape[0] != nb:  # its columns are not checked: that would read the device
        raise ValueError(f"pack_tiles_many: a layout of {layout.order.shape[0]} block rows, weights of {nb}")
    nnz = layout.order.shape[1]
    rows = torch.arange(nb, device=weights.device).view(-1, 1)
    tiles = blocks[:, rows, layout.order] * layout.present.view(1, nb, nnz, 1, 1).to(weights.dtype)
    tiles = tiles.contiguous()  # [L, NB, NNZ, BN, BK]
    return [TiledWeight(tiles[i], layout.index, n, k) for i in range(count)]


# --- PyTorch reference ---------------------------------------------------------------------------


def tile_linear_ref(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, K] or [G, B, K] → [B, N] or [G, B, N] from the packed tiles, in fp32 (fp64 for fp64
    x), y in x's dtype."""
    if x.dim() == 3:
        return tile_linear_ref(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:2], -1)
    ct = torch.promote_types(x.dtype, torch.float32)
    nb, nnz, bn, bk = weight.tiles.shape
    b, k = x.shape
    kb = -(-k // bk)
    xb = F.pad(x.to(ct), (0, kb * bk - k)).view(b, kb, bk)
    idx = weight.index.long()
    xg = xb[:, idx.clamp(min=0)] * (idx >= 0).view(1, nb, nnz, 1).to(ct)  # [B, NB, NNZ, BK]
    y = torch.einsum("bnjk,njok->bno", xg, weight.tiles.to(ct)).reshape(b, nb * bn)[:, : weight.out_features]
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype)


# --- Triton kernel -------------------------------------------------------------------------------


@triton.jit
def _tile_linear_kernel(
    X, TILES, INDEX, BIAS, Y, stride_xg, stride_xb, rows_per_group, stride_yb,
    IN_FEATURES: tl.constexpr, OUT_FEATURES: tl.constexpr, NNZ: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # One program per (block row, row of x): the block row's few tiles, each a [BLOCK_N, BLOCK_K]
    # load times a [BLOCK_K] slice of x, summed in fp32. Padding tiles are zeros and their index
    # −1 masks the x slice too. The loop is unrolled (NNZ is small and fixed): every tile's load
    # is issued before the first sum needs it, one memory latency instead of NNZ in a row.
    # x's rows come in groups (x [G, B, K]: row g·B + b at g·stride_xg + b·stride_xb), so that
    # overlapping windows of a [G, n + K − 1, C] sequence are read in place, not copied out.
    nb = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    group = row // rows_per_group
    x_row = X + group * stride_xg + (row - group * rows_per_group) * stride_xb
    o = tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(NNZ):
        kb = tl.load(INDEX + nb * NNZ + j)
        cols = kb * BLOCK_K + kk
        xv = tl.load(x_row + cols, mask=(kb >= 0) & (cols < IN_FEATURES), other=0.0)
        tile = tl.load(TILES + ((nb * NNZ + j) * BLOCK_N + o[:, None]) * BLOCK_K + kk[None, :])
        acc += tl.sum(tile.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    outs = nb * BLOCK_N + o
    out_mask = outs < OUT_FEATURES
    if HAS_BIAS:
        acc += tl.load(BIAS + outs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_yb + outs, to_output_dtype(acc, Y.dtype.element_ty), mask=out_mask)


# --- host launcher -------------------------------------------------------------------------------

_PLANS = plan_cache()


def _check(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None) -> None:
    """Inputs that no path can use: a ValueError naming them on every path (not a kernel fallback)."""
    if x.dim() not in (2, 3) or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"tile_linear: x must be [B, {weight.in_features}] or [G, B, {weight.in_features}], "
            f"got {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"tile_linear: bias must be [{weight.out_features}], got {tuple(bias.shape)}")
    check_devices("tile_linear", "x bias", x, bias)
    tiles, index = weight.tiles, weight.index
    if tiles.dim() != 4 or tiles.device != x.device:
        raise ValueError(
            f"tile_linear: the weight's tiles must be [NB, NNZ, block_n, block_k] on x's device "
            f"{x.device} (pack_tiles makes them), got {list(tiles.shape)} on {tiles.device}"
        )
    if index.dtype != torch.int32 or index.shape != tiles.shape[:2] or index.device != tiles.device:
        raise ValueError(
            f"tile_linear: the weight's index must be {list(tiles.shape[:2])} int32 on {tiles.device} "
            f"(pack_tiles makes it), got {index.dtype} {list(index.shape)} on {index.device}"
        )


def tile_linear_launch(
    x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch the kernel (arguments as :func:`tile_linear`). x's rows may be strided (and may
    overlap), each row contiguous; the tiles must be contiguous (:func:`pack_tiles` makes them so)."""
    contiguous = weight.tiles.is_contiguous() and weight.index.is_contiguous()
    if x.stride(-1) != 1 or not contiguous or (bias is not None and not bias.is_contiguous()):
        raise ValueError("tile_linear: x's rows, the packed tiles and the bias must be contiguous")
    y = torch.empty(*x.shape[:-1], weight.out_features, dtype=x.dtype, device=x.device)
    rows = y.numel() // weight.out_features
    if rows == 0:
        return y
    # [B, K] is one group of B rows; [G, B, K] is G groups
    per_group, stride_g, stride_row = (
        (x.shape[1], x.stride(0), x.stride(1)) if x.dim() == 3 else (rows, 0, x.stride(0))
    )
    nb, nnz, bn, bk = weight.tiles.shape
    key = (rows, per_group, stride_g, stride_row, weight.in_features, weight.out_features, nnz, bn, bk,
           bias is not None, x.dtype, weight.tiles.dtype, weight.index.dtype,
           None if bias is None else bias.dtype, x.get_device())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        consts = {"IN_FEATURES": weight.in_features, "OUT_FEATURES": weight.out_features, "NNZ": nnz,
                  "BLOCK_N": bn, "BLOCK_K": bk, "HAS_BIAS": bias is not None}  # fmt: skip
        warps = 4 if bn * bk <= 4096 else 8
        plan = _PLANS[key] = LaunchPlan(_tile_linear_kernel, (nb, rows), consts, warps, 1, x.get_device())
    bias_arg = weight.index if bias is None else bias  # any pointer when HAS_BIAS is off
    with device_guard(x):
        plan(x, weight.tiles, weight.index, bias_arg, y, stride_g, stride_row, per_group, weight.out_features)
    return y


# --- public function -----------------------------------------------------------------------------


def tile_linear(x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x·Wᵀ + bias`` for x [B, K] or [G, B, K] (bf16/fp16/fp32; its rows may be strided and
    overlap, as a sequence's sliding windows do) and a packed weight (:func:`pack_tiles`), bias [N]
    or None → [B, N] or [G, B, N] in x's dtype, accumulated in fp32. The Triton kernel runs where
    hydra_kernels' Triton path is on for x's device; fp64 x, a switched-off path or another
    device run :func:`tile_linear_ref`."""
    _check(x, weight, bias)
    if x.stride(-1) != 1:  # the kernel reads rows with unit stride
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():  # and bias[n] at offset n (a strided bias: wrong sums)
        bias = bias.contiguous()
    if not (weight.tiles.is_contiguous() and weight.index.is_contiguous()):  # the kernel's layout
        weight = TiledWeight(weight.tiles.contiguous(), weight.index.contiguous(), weight.out_features,
                             weight.in_features)  # fmt: skip
    if not (x.dtype in KERNEL_DTYPES and controls.triton_path("tile_linear", x, weight.tiles)):
        return tile_linear_ref(x, weight, bias)
    return run_with_fallback(
        "tile_linear", lambda: tile_linear_launch(x, weight, bias), lambda: tile_linear_ref(x, weight, bias)
    )
