"""The chunk loop of ``linear_cross_entropy``: host code shared by the Triton path and the
PyTorch path (which runs the same chunks with PyTorch ops where the row kernel would run).

Per chunk of C tokens: ``logits = h_c @ Wᵀ`` (cuBLAS, one reused ``[C, V]`` buffer), the row
step (loss, and the logits' gradient in place), ``dh_c = dlogits @ W`` straight into rows of dh,
and ``dW (+)= dlogitsᵀ @ h_c`` into the accumulator. Nothing ``[N, V]``-sized is allocated.

``dw_accum="compensated"`` keeps dW in its own 16-bit tensor plus a 4-bit residual per element
(``_linear_ce_compensated``): the precision of an fp32 accumulator for V·D/2 extra bytes, and an
automatic chunk that fits twice Liger's workspace.

``dw_accum="slab"`` adds no accumulator at all: the chunk loop computes the loss, each row's
log-sum-exp and dh only; then a second loop over vocabulary slabs of S rows recomputes
``logits_s = h @ W_sᵀ`` for every token (``[N, S]``, in the same buffer), turns it into the
gradient from the stored log-sum-exps, and forms ``dW_s = dlogits_sᵀ @ h`` in one GEMM over all
tokens, rounded once — the precision of one full GEMM with the memory of one chunk. Cost: a
fourth matmul (the logits once more).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hydra_kernels.ops import _linear_ce_compensated as comp
from hydra_kernels.ops import _linear_ce_kernels as K

DW_ACCUM_MODES = ("fp32", "input", "slab", "compensated")
DW_BACKENDS = ("auto", "cublas", "triton", "torch")


@dataclass(frozen=True)
class LinearCEOptions:
    """``chunk_rows``: tokens per chunk, 0 = automatic. ``dw_accum``: ``"fp32"`` (a running fp32
    accumulator over token chunks), ``"input"`` (a running accumulator in the weight's dtype:
    less memory, rounding per chunk), ``"slab"`` (no accumulator: dW per vocabulary slab in one
    GEMM after a second logits pass; see the module docstring) or ``"compensated"`` (the 16-bit
    gradient itself plus a 4-bit residual plane; ``_linear_ce_compensated``). ``dw_backend``: who adds a chunk
    into an fp32 accumulator from 16-bit operands: ``"auto"``, ``"cublas"``, ``"triton"`` or
    ``"torch"`` (widen the chunk to fp32 first)."""

    chunk_rows: int = 0
    dw_accum: str = "fp32"
    dw_backend: str = "auto"

    def validated(self) -> LinearCEOptions:
        """Self, or a ValueError naming the bad field."""
        if not isinstance(self.chunk_rows, int) or self.chunk_rows < 0:
            raise ValueError(f"linear_cross_entropy chunk_rows must be an int ≥ 0, got {self.chunk_rows!r}")
        if self.dw_accum not in DW_ACCUM_MODES:
            raise ValueError(
                f"linear_cross_entropy dw_accum must be one of {DW_ACCUM_MODES}, got {self.dw_accum!r}"
            )
        if self.dw_backend not in DW_BACKENDS:
            raise ValueError(
                f"linear_cross_entropy dw_backend must be one of {DW_BACKENDS}, got {self.dw_backend!r}"
            )
        return self


def acc_dtype_for(compute_dtype: torch.dtype, weight_dtype: torch.dtype, dw_accum: str) -> torch.dtype:
    """dtype of the dW accumulator: at least fp32 unless the mode asked for the weight's ("input",
    "slab", and "compensated", where a 16-bit result comes with its residual plane)."""
    widest = torch.promote_types(compute_dtype, weight_dtype)
    if dw_accum in ("input", "slab", "compensated"):
        return widest
    return torch.promote_types(widest, torch.float32)


def compensates(acc_dtype: torch.dtype, opts: LinearCEOptions) -> bool:
    """Whether dW is accumulated as a 16-bit value plus a residual plane."""
    return opts.dw_accum == "compensated" and acc_dtype.itemsize == 2


def chunk_rows_for(
    n: int,
    d: int,
    v: int,
    acc_dtype: torch.dtype,
    opts: LinearCEOptions,
    itemsize: int = 2,
    need_dw: bool = True,
) -> int:
    """Tokens per chunk. Set: as given. Automatic, with a 4-byte accumulator: 2²²/D rows, in
    [1024, 4096], rounded up to 128: the dW GEMM reads and writes the whole fp32 accumulator once
    per chunk, so fewer, larger chunks win (measured on an H100 at D = 768, V = 50304: 4096 rows
    7.2 ms, 2048 rows 7.9 ms, 1024 rows 8.9 ms; at D = 2048, V = 128256: 2048 rows 42.6-44.8 ms,
    1024 rows 47.0 ms; see BENCHMARKS.md), and ≥ 1024 rows give the dh GEMM (whose reduction
    runs over V) enough output tiles to fill the GPU without split-K. In the lean
    mode, Liger's rule: the chunk's logits hold as many elements as ``hidden``. In the slab mode,
    Liger's own sizing (``next_power_of_2(N / ceil(V / D))`` rows), so that the one buffer of the
    call takes what Liger's chunk takes. In the compensated mode, the largest chunk that fits twice
    Liger's logits chunk beside the residual plane (``compensated_chunk_rows``; ``itemsize`` is
    the logits' and ``need_dw`` says whether the plane is allocated)."""
    if opts.chunk_rows:
        rows = opts.chunk_rows
    elif opts.dw_accum == "compensated":
        rows = comp.compensated_chunk_rows(n, d, v, itemsize, need_dw and acc_dtype.itemsize == 2)
    elif opts.dw_accum == "slab":
        rows = comp.liger_chunk_rows(n, d, v)
        # Liger's chunk holds all its workspace; this call also keeps each token's loss and
        # log-sum-exp (fp32): give those rows back so the total stays within Liger's.
        rows = max(1, rows - -(-8 * n // (2 * v)))
    else:
        want = 2**22 // d if acc_dtype.itemsize >= 4 else -(-n * d // v)
        lo = 1024 if acc_dtype.itemsize >= 4 else 128
        rows = -(-min(max(want, lo), 4096) // 128) * 128
    return max(1, min(rows, n))


def slab_cols_for(n: int, v: int, rows: int) -> int:
    """Vocabulary rows per slab of the slab mode: the ``[N, S]`` slab fits in the ``[C, V]``
    chunk buffer (S = C·V/N), rounded down to a multiple of 64 (at least 64)."""
    return min(v, max(64, rows * v // max(n, 1) // 64 * 64))


def _ce_rows_torch(lg, targets, loss_out, scale, ignore_index, z_loss, write_grad, lse_out=None) -> None:
    """PyTorch twin of ``_ce_rows_kernel`` on one chunk (used when Triton does not run)."""
    sdt = torch.promote_types(lg.dtype, torch.float32)
    x = lg.to(sdt)
    lse = torch.logsumexp(x, dim=1)
    if lse_out is not None:
        lse_out.copy_(lse)
    valid = targets != ignore_index
    in_range = (targets >= 0) & (targets < lg.shape[1])
    hit = valid & in_range
    y = torch.where(hit, targets, 0)
    loss = lse - x.gather(1, y[:, None])[:, 0]
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(in_range, loss, torch.nan)
    loss_out.copy_(torch.where(valid, loss, 0.0))
    if write_grad:
        sc = torch.where(valid, scale.to(sdt), 0.0).expand(lg.shape[0])
        coef = sc * (1.0 + 2.0 * z_loss * lse) if z_loss else sc
        # fp32 logits (x is lg) are overwritten in place: the loss is already out.
        x.sub_(lse[:, None]).exp_().mul_(coef[:, None])
        x.scatter_add_(1, y[:, None], -(sc * hit)[:, None])
        if x is not lg:
            lg.copy_(x)


def _ce_slab_grad_torch(slab, col0, lse, targets, scale, ignore_index, z_loss) -> None:
    """PyTorch twin of ``_ce_slab_grad_kernel``: the slab's logits → their gradient, in place."""
    sdt = torch.promote_types(slab.dtype, torch.float32)
    x = slab.to(sdt)
    lse = lse.to(sdt)
    valid = targets != ignore_index
    sc = torch.where(valid, scale.to(sdt), 0.0).expand(slab.shape[0])
    coef = sc * (1.0 + 2.0 * z_loss * lse) if z_loss else sc
    g = torch.exp(x - lse[:, None]) * coef[:, None]
    cols = torch.arange(col0, col0 + slab.shape[1], device=slab.device)
    g = torch.where(cols[None, :] == targets[:, None], g - sc[:, None], g)
    slab.copy_(g)


@functools.lru_cache(maxsize=8)
def _cublas_fp32_out_ok(device_index: int, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc32, a16, b16, out_dtype=torch.float32, out=acc32)`` works here,
    both adding into the fp32 accumulator and, with ``beta=0``, overwriting it (NaN included).
    Older torch builds reject an fp32 ``self`` with 16-bit operands. Probed once per device."""
    dev = torch.device("cuda", device_index)
    gen = torch.Generator().manual_seed(0)
    a, b, acc = (torch.randn(s, generator=gen) for s in ((48, 32), (32, 40), (48, 40)))
    prod = a.to(dtype).double() @ b.to(dtype).double()
    a16, b16 = a.to(dev, dtype), b.to(dev, dtype)
    try:
        added = acc.to(dev)
        torch.addmm(added, a16, b16, out_dtype=torch.float32, out=added)
        fresh = torch.full_like(added, float("nan"))
        torch.addmm(fresh, a16, b16, beta=0, out_dtype=torch.float32, out=fresh)
        ok_add = torch.allclose(added.double().cpu(), acc.double() + prod, rtol=1e-5, atol=1e-5)
        return bool(ok_add and torch.allclose(fresh.double().cpu(), prod, rtol=1e-5, atol=1e-5))
    except (RuntimeError, TypeError):
        return False


def cublas_backend_error(
    opts: LinearCEOptions, device: torch.device, compute_dtype: torch.dtype, weight_dtype: torch.dtype
) -> str | None:
    """Why ``dw_backend="cublas"`` cannot add this call's dW chunks (None when it can, or another
    backend is asked for). Checked before the call: raised from inside the chunk loop it was
    counted as a Triton kernel fault, warned as a fallback to the reference, then raised by the
    reference too."""
    if opts.dw_backend != "cublas":
        return None
    acc_dtype = acc_dtype_for(compute_dtype, weight_dtype, opts.dw_accum)
    if acc_dtype == compute_dtype or compensates(acc_dtype, opts):
        return None  # plain cuBLAS in one dtype, or the compensated scheme: no fp32-out GEMM
    if device.type == "cuda" and _cublas_fp32_out_ok(device.index or 0, compute_dtype):
        return None
    return (
        f"linear_cross_entropy: dw_backend='cublas' needs torch.addmm(..., out_dtype=torch.float32) "
        f"for {compute_dtype} operands, which {device} does not have here; use dw_backend='auto' "
        "(set_linear_ce_options or HYDRA_LINEAR_CE_DW_BACKEND)"
    )


def _accumulate_dw(acc, g, h_c, first: bool, use_triton: bool, backend: str, capacity: int) -> None:
    """``acc (+)= gᵀ @ h_c``; ``first`` overwrites (no zero-fill pass over the accumulator)."""
    gt = g.t()
    if acc.dtype == g.dtype:  # one dtype (fp32 throughout, or the lean mode): plain cuBLAS
        if first:
            torch.mm(gt, h_c, out=acc)
        else:
            acc.addmm_(gt, h_c)
        return
    if backend in ("auto", "cublas") and acc.is_cuda and _cublas_fp32_out_ok(acc.device.index or 0, g.dtype):
        torch.addmm(acc, gt, h_c, beta=0 if first else 1, out_dtype=torch.float32, out=acc)
        return
    if backend == "cublas":
        raise RuntimeError("dw_backend='cublas' needs torch.addmm(..., out_dtype=torch.float32) on CUDA")
    if use_triton and backend != "torch":
        K.launch_dw_accum(acc, g, h_c, accumulate=not first, capacity=capacity)
        return
    wide = torch.mm(gt.to(acc.dtype), h_c.to(acc.dtype))  # exact widening, then one fp32 GEMM
    acc.copy_(wide) if first else acc.add_(wide)


#: The logits' row length is padded to a multiple of this many columns: cuBLAS runs an output or
#: operand whose leading dimension is not 16-byte aligned with slow alignment-1/2 kernels (a
#: tokenizer's 27813-token vocabulary made hydra-train's 100M step 1.45x slower on an H100,
#: packages/hydra-kernels/BENCHMARKS.md).
PAD_COLS = 64


def padded_cols(v: int, opts: LinearCEOptions) -> int:
    """The logits' row length for a ``V``-row weight: in the default (fp32 dW, speed) mode, V
    rounded up to :data:`PAD_COLS` (the zero rows added to the weight give zero logits, left out of
    the softmax and of dh; their dW rows are dropped); V itself in the memory-lean modes (input,
    slab, compensated), whose workspace stays as documented. Padding costs a copy of the weight
    (V·D in the compute dtype) where none was needed before (a weight already in the compute
    dtype): 43 MB at V = 27813, D = 768 (packages/hydra-train/BENCHMARKS.md has what it buys)."""
    return -(-v // PAD_COLS) * PAD_COLS if opts.dw_accum == "fp32" else v


def _padded_weight(weight: torch.Tensor, cdt: torch.dtype, vp: int) -> torch.Tensor:
    """``weight`` [V, D] in the compute dtype with ``vp − V`` zero rows below (one copy; none when
    neither a cast nor padding is needed)."""
    v, d = weight.shape
    if vp == v:
        return weight if weight.dtype == cdt else weight.to(cdt)
    w = torch.empty((vp, d), dtype=cdt, device=weight.device)
    w[:v].copy_(weight)
    w[v:].zero_()
    return w


def chunked_pass(hidden, weight, targets, ignore_index, z_loss, scale, need_dh, need_dw, use_triton, opts):
    """Per-token loss and, when asked, dh and the dW accumulator, scaled by ``scale`` (0-d or
    per token). Never holds more than one ``[chunk, V]`` block of logits (rows padded to
    :func:`padded_cols`)."""
    n, d = hidden.shape
    v = weight.shape[0]
    cdt = hidden.dtype
    acc_dtype = acc_dtype_for(cdt, weight.dtype, opts.dw_accum)
    vp = padded_cols(v, opts)
    w = _padded_weight(weight, cdt, vp)  # [Vp, D] in the compute dtype
    rows = chunk_rows_for(n, d, vp, acc_dtype, opts, cdt.itemsize, need_dw)
    slabs = need_dw and opts.dw_accum == "slab"
    dev = hidden.device
    loss_rows = torch.empty(n, dtype=torch.promote_types(cdt, torch.float32), device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev) if slabs else None
    dh = torch.empty((n, d), dtype=cdt, device=dev) if need_dh else None
    dw = (torch.empty if n else torch.zeros)((vp, d), dtype=acc_dtype, device=dev) if need_dw else None
    plane = None  # the 4-bit residuals of a compensated dW (no zero fill: the first chunk writes it)
    if need_dw and n and compensates(acc_dtype, opts):
        plane = torch.empty(comp.plane_shape(v, d), dtype=torch.uint8, device=dev)
    slab_cols = slab_cols_for(n, v, rows) if slabs else 0
    buffer = torch.empty(max(rows * vp, n * slab_cols), dtype=cdt, device=dev) if n else None
    write_grad = need_dh or (need_dw and not slabs)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        h_c = hidden[start:stop]  # [c, D]
        lg = buffer[: (stop - start) * vp].view(stop - start, vp)  # [c, Vp]; columns ≥ V: 0 again
        torch.mm(h_c, w.t(), out=lg)
        sc = scale[start:stop] if scale.dim() else scale
        rows_v = lg[:, :v]  # the real vocabulary's columns (row stride Vp)
        row_args = (rows_v, targets[start:stop], loss_rows[start:stop], sc, ignore_index, z_loss, write_grad)
        if slabs:  # the slab pass needs each row's log-sum-exp
            row_args += (lse[start:stop],)
        if use_triton:
            K.launch_ce_rows(*row_args)
        else:
            _ce_rows_torch(*row_args)
        if need_dh:
            torch.mm(lg, w, out=dh[start:stop])
        if plane is not None:
            comp.accumulate_compensated(dw, plane, lg, h_c, start == 0, use_triton, rows)
        elif need_dw and not slabs:
            _accumulate_dw(dw, lg, h_c, start == 0, use_triton, opts.dw_backend, rows)
    if slabs and n:
        for v0 in range(0, v, slab_cols):
            v1 = min(v0 + slab_cols, v)
            sl = buffer[: n * (v1 - v0)].view(n, v1 - v0)  # [N, S]
            torch.mm(hidden, w[v0:v1].t(), out=sl)
            if use_triton:
                K.launch_ce_slab_grad(sl, v0, lse, targets, scale, ignore_index, z_loss)
            else:
                _ce_slab_grad_torch(sl, v0, lse, targets, scale, ignore_index, z_loss)
            _accumulate_dw(dw[v0:v1], sl, hidden, True, use_triton, opts.dw_backend, n)
    return loss_rows, dh, (dw if dw is None or vp == v else dw[:v])  # the weight's rows (contiguous)
