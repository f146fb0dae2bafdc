"""CCGQA's causal conv stage with its taps folded per head: z[t, g] = Σ_s W[g, s] · u[t − K + 1 + s, g].

Faces: the PyTorch reference ``ccgqa_conv_ref`` (an unfold and a batched GEMM: what
hydra_model's CCGQA ran before), Triton kernels (in ``ops/_ccgqa_conv_kernels.py``) with host
launchers, custom ops ``hydra_kernels::ccgqa_conv_fwd`` / ``hydra_kernels::ccgqa_conv_bwd`` (what
torch.compile traces), and the public :func:`ccgqa_conv` choosing between them.

Inputs: ``window`` [B, n + K − 1, C] — each sequence's packed pre-conv channels with K − 1 rows
of left context in front (zeros at a sequence start); ``weight`` [G, K, d, d] — per head g = C / d
and window offset s, the [out, in] matrix of both convs folded together
(``hydra_model.ccgqa_fold.headwise_qk_weight`` rearranged); ``bias`` [C]. Output z [B, n, G, d]
in the window's dtype: row t reads window rows t .. t + K − 1.

Why a kernel: the reference materialises the unfolded taps ([B, n, C·K], K times the input),
multiplies them by a batched GEMM whose N is one head (64 wide, far from tensor-core peak), and
its backward writes the taps' gradient and folds it back. At the 100M preset that was the
largest piece of HYDRA's compiled step outside GEMMs and attention
(packages/hydra-kernels/BENCHMARKS.md, 2026-11-27). The kernels read each row block once per
offset straight from the window and accumulate the K small products in registers:

* ``_ccgqa_conv_fwd_kernel`` — a program per (row block, head, sequence): Σ_s tl.dot over the
  K shifted row blocks, plus the bias, stored once;
* ``_ccgqa_conv_dwin_kernel`` — the window's gradient, the same shape of work with the offsets
  reversed (row r gathers dz[r − s] · W[g, s]);
* ``_ccgqa_conv_dw_kernel`` — the weight's and the bias's gradients: a program per (head,
  offset, token split) sums dzᵀ · window over its share of the row blocks into fp32 partials,
  which the host adds (a few per head: no atomics, the same bits every call).

With ``qk_mean_heads`` = Q > 0 the output also carries CCGQA's q-k mean of the current token's
own channels (u = the window's row t + K − 1, heads 0..Q−1 queries, the rest keys, G = Q /
(heads − Q) queries a key): query head h gets (u[h] + u[Q + h // G]) / 2, key head j the mean of
its G query heads' values of that, i.e. u[Q + j] / 2 + Σ u[j·G + i] / (2G). The forward kernel
adds it before its one rounding (the model added it to the rounded z as another elementwise
pass), the window-gradient kernel adds its transpose for row t + K − 1.

Products run on tensor cores in the input's dtype with fp32 accumulation (fp32 inputs take IEEE
products, not TF32, for heads up to :data:`FP32_MAX_HEAD_DIM`); the weight is cast to the
window's dtype for them and the bias read as fp32; their gradients are summed in fp32 and
returned in their own dtypes. fp64 runs the reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from hydra_kernels import controls
from hydra_kernels.launch_config import LaunchConfig, resolve_launch_config
from hydra_kernels.ops._ccgqa_conv_kernels import (
    _ccgqa_conv_dw_kernel,
    _ccgqa_conv_dwin_kernel,
    _ccgqa_conv_fwd_kernel,
)
from hydra_kernels.ops._custom_op import (
    cdiv,
    check_devices,
    compiling,
    device_guard,
    eager_apply,
    eager_autograd_function,
    multiprocessor_count,
    next_power_of_2,
    run_with_fallback,
)

#: The kernels' launch: rows per program (``block_rows``, a power of two ≥ 16: tl.dot's smallest
#: tile), warps and pipeline stages; one entry for every GPU generation. Swept on an H100 at the
#: 100M preset's shape with DW_PROGRAMS_PER_SM (rows 32/64/128 × warps 4/8 × 2–32 programs an SM):
#: 128 rows, 4 warps, 4 programs took the backward from 0.139 ms (64 rows, 2 programs) to 0.086 ms,
#: the forward unchanged at 0.037 ms (packages/hydra-kernels/BENCHMARKS.md, 2026-11-27)
LAUNCH: dict[str, LaunchConfig] = {"default": LaunchConfig(num_warps=4, num_stages=2, block_rows=128)}
#: Head widths the kernels take: powers of two that tl.dot tiles (others run the reference).
HEAD_DIMS = (16, 32, 64, 128)
#: The widest head fp32 windows run the kernels with, in at most FP32_MAX_ROWS rows a program:
#: IEEE fp32 products are not tensor-core work, and a [rows, 128] × [128, 128] fp32 product took
#: Triton minutes to compile for sm_90 (a review's measurement; 1.3 s in bf16)
FP32_MAX_HEAD_DIM = 64
FP32_MAX_ROWS = 64
#: Most window offsets (taps) the kernels unroll.
MAX_TAPS = 8
#: Target programs per SM of the weight-gradient kernel (it splits the tokens to get there).
DW_PROGRAMS_PER_SM = 4


# --- PyTorch reference ---------------------------------------------------------------------------


def qk_mean_ref(u: torch.Tensor, n_q: int, d: int) -> torch.Tensor:
    """CCGQA's q-k mean of the current token's pre-conv channels ``u`` [B, n, C] (C = heads·d,
    the ``n_q`` query heads first) → [B, n, heads, d] in u's dtype: query head h gets (u_q[h] +
    u_k[h // G]) / 2, key head j the mean of those over its G = n_q / (heads − n_q) query heads."""
    b, n, c = u.shape
    n_kv = c // d - n_q
    q_pre = u[..., : n_q * d].reshape(b, n, n_kv, n_q // n_kv, d)
    k_pre = u[..., n_q * d :].reshape(b, n, n_kv, 1, d)
    mean = 0.5 * (q_pre + k_pre)  # [B, n, n_kv, G, d]
    return torch.cat([mean.reshape(b, n, n_q, d), mean.mean(3)], dim=2)


def ccgqa_conv_ref(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> torch.Tensor:
    """Reference: the taps unfolded ([B, n, G, d, K]) and one batched product per head in the
    window's dtype (autocast's choice, as the model ran it), the bias added in that dtype; with
    ``qk_mean_heads`` the q-k mean (:func:`qk_mean_ref`) added in it too, as the model did.
    ``zero_context``: ``window`` is [B, n, C] and its K − 1 rows of left context are zeros."""
    g, k, d, _ = weight.shape
    if zero_context:
        window = F.pad(window, (0, 0, k - 1, 0))
    b, length, _ = window.shape
    n = length - k + 1
    taps = window.unfold(1, k, 1).reshape(b, n, g, d, k)  # [B, n, G, i, s] = window[t + s, g·d + i]
    z = torch.einsum("bngis,gsoi->bngo", taps, weight.to(taps.dtype))
    z = z + bias.view(g, d).to(z.dtype)
    if qk_mean_heads:
        z = z + qk_mean_ref(window[:, k - 1 :], qk_mean_heads, d).to(z.dtype)
    return z


# --- Triton kernels: ops/_ccgqa_conv_kernels.py ---------------------------------------------


# --- host launchers ------------------------------------------------------------------------------


def _shape_error(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> str | None:
    """Why these are not a window, per-tap weight and bias of one conv stage, or ``qk_mean_heads``
    not a query-head count of its heads (None when they are)."""
    if window.dim() != 3 or weight.dim() != 4 or bias.dim() != 1:
        return (
            f"ccgqa_conv: expected window [B, n + K - 1, C], weight [G, K, d, d], bias [C]; got "
            f"{tuple(window.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    g, k, d, d_in = weight.shape
    c = window.shape[-1]
    if d != d_in or g * d != c or bias.numel() != c or window.shape[1] < (1 if zero_context else k):
        return (
            f"ccgqa_conv: weight {tuple(weight.shape)} needs square [d, d] blocks with G·d = C = {c} "
            f"channels, bias [C] and a window of at least K = {k} rows; got window "
            f"{tuple(window.shape)}, bias {tuple(bias.shape)}"
        )
    if qk_mean_heads and not (0 < qk_mean_heads < g and qk_mean_heads % (g - qk_mean_heads) == 0):
        return (
            f"ccgqa_conv: qk_mean_heads={qk_mean_heads} must be the query heads of the {g} heads, a "
            "multiple of the key heads (the rest), or 0 for no q-k mean"
        )
    return None


def _kernel_refusal(window: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernels do not take a well-shaped call (None when they do): fp64, heads not in
    :data:`HEAD_DIMS` (fp32: wider than :data:`FP32_MAX_HEAD_DIM`), more than :data:`MAX_TAPS`
    taps, channels not contiguous."""
    _, k, d, _ = weight.shape
    widest = FP32_MAX_HEAD_DIM if window.dtype == torch.float32 else max(HEAD_DIMS)
    if window.dtype == torch.float64 or d not in HEAD_DIMS or d > widest or k > MAX_TAPS:
        return (
            f"ccgqa_conv: window {window.dtype}, weight {tuple(weight.shape)}: the kernels take square "
            f"heads of {HEAD_DIMS} (fp32: up to {FP32_MAX_HEAD_DIM}), ≤ {MAX_TAPS} taps, no fp64"
        )
    if window.stride(-1) != 1:
        return "ccgqa_conv: the window's channels must be contiguous"
    return None


def _check(
    window, weight, bias, zero_context: bool, qk_mean_heads: int = 0
) -> tuple[int, int, int, int, int]:
    """(G, K, d, n, PAD) for inputs the kernels take; raises (→ counted fallback) otherwise, which
    only a direct call of the custom ops can reach (the public function checks first). PAD: the
    window's zero rows in front that are not stored (K − 1 with ``zero_context``, else 0)."""
    error = _shape_error(window, weight, bias, zero_context, qk_mean_heads) or _kernel_refusal(window, weight)
    if error:
        raise ValueError(error)
    g, k, d, _ = weight.shape
    pad = k - 1 if zero_context else 0
    return g, k, d, window.shape[1] - k + 1 + pad, pad


def _qk_mean_args(heads: int, qk_mean_heads: int) -> dict[str, int]:
    """The kernels' q-k mean constants: N_Q query heads (0: none), GROUP of them a key head."""
    return {"N_Q": qk_mean_heads, "GROUP": qk_mean_heads // (heads - qk_mean_heads) if qk_mean_heads else 1}


def _launch(device: torch.device, dtype: torch.dtype) -> LaunchConfig:
    cfg = resolve_launch_config("ccgqa_conv", device, LAUNCH)
    if cfg.block_rows < 16 or cfg.block_rows & (cfg.block_rows - 1):
        raise ValueError(f"ccgqa_conv: block_rows={cfg.block_rows} must be a power of two ≥ 16")
    if dtype == torch.float32 and cfg.block_rows > FP32_MAX_ROWS:
        cfg = replace(cfg, block_rows=FP32_MAX_ROWS)
    return cfg


def ccgqa_conv_fwd_launch(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> torch.Tensor:
    """Run the forward kernel: z [B, n, G, d], contiguous, in the window's dtype."""
    g, k, d, n, pad = _check(window, weight, bias, zero_context, qk_mean_heads)
    b = window.shape[0]
    z = window.new_empty(b, n, g, d)
    if z.numel() == 0:
        return z
    # the products' operands in the window's dtype (as the reference's einsum takes them)
    weight, bias = weight.to(window.dtype).contiguous(), bias.contiguous()
    cfg = _launch(window.device, window.dtype)
    with device_guard(window):
        _ccgqa_conv_fwd_kernel[(cdiv(n, cfg.block_rows), g, b)](
            window, weight, bias, z, n, window.stride(0), window.stride(1),
            N_HEADS=g, K=k, D=d, BLOCK_T=cfg.block_rows, IEEE=window.dtype == torch.float32, PAD=pad,
            **_qk_mean_args(g, qk_mean_heads), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return z


def ccgqa_conv_bwd_launch(
    dz: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the backward kernels: (d window, d weight, d bias), each in its input's dtype."""
    g, k, d, n, pad = _check(window, weight, bias, zero_context, qk_mean_heads)
    b, length, _ = window.shape
    if dz.shape != (b, n, g, d):  # the kernels would read past it
        raise ValueError(f"ccgqa_conv: dz must be the output's shape {(b, n, g, d)}, got {tuple(dz.shape)}")
    dz = dz.contiguous()
    dwin = torch.empty(window.shape, dtype=window.dtype, device=window.device)
    if window.numel() == 0 or n == 0:
        return dwin.zero_(), weight.new_zeros(weight.shape), bias.new_zeros(bias.shape)
    w_in = weight.to(window.dtype).contiguous()
    ieee = window.dtype == torch.float32
    cfg = _launch(window.device, window.dtype)
    block_t, warps, stages = cfg.block_rows, cfg.num_warps, cfg.num_stages
    blocks_per_seq = cdiv(n, block_t)
    n_blocks = b * blocks_per_seq
    target = max(1, DW_PROGRAMS_PER_SM * multiprocessor_count(window.device) // (g * k))
    iters = next_power_of_2(cdiv(n_blocks, target))
    splits = cdiv(n_blocks, iters)
    pw = torch.empty(splits, g, k, d, d, dtype=torch.float32, device=window.device)
    pb = torch.empty(splits, g, d, dtype=torch.float32, device=window.device)
    with device_guard(window):
        _ccgqa_conv_dwin_kernel[(cdiv(length, block_t), g, b)](
            dz, w_in, dwin, n, N_HEADS=g, K=k, D=d, BLOCK_T=block_t, IEEE=ieee, PAD=pad,
            **_qk_mean_args(g, qk_mean_heads), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        _ccgqa_conv_dw_kernel[(g, k, splits)](
            dz, window, pw, pb, n, n_blocks, blocks_per_seq, window.stride(0), window.stride(1),
            N_HEADS=g, K=k, D=d, BLOCK_T=block_t, ITERS=iters, IEEE=ieee, PAD=pad, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    dw, db = pw.sum(0), pb.sum(0).reshape(-1)
    return dwin, dw.to(weight.dtype), db.to(bias.dtype)


# --- implementations behind the custom ops (Triton with a counted fallback) ---------------------


def _ccgqa_conv_backward_ref(dz, window, weight, bias, zero_context: bool = False, qk_mean_heads: int = 0):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (window, weight, bias)]
        out = ccgqa_conv_ref(*leaves, zero_context, qk_mean_heads)
        # contiguous, as the kernels return them (and the custom op's fake says)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, leaves, dz))


def _ccgqa_conv_forward(
    window, weight, bias, zero_context: bool = False, qk_mean_heads: int = 0
) -> torch.Tensor:
    return run_with_fallback(
        "ccgqa_conv",
        lambda: ccgqa_conv_fwd_launch(window, weight, bias, zero_context, qk_mean_heads),
        lambda: ccgqa_conv_ref(window, weight, bias, zero_context, qk_mean_heads).contiguous(),
    )


def _ccgqa_conv_backward(
    dz, window, weight, bias, zero_context: bool = False, qk_mean_heads: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    reference = lambda: _ccgqa_conv_backward_ref(dz, window, weight, bias, zero_context, qk_mean_heads)
    # read at run time, so the switch holds inside compiled graphs too
    if not controls.triton_path("ccgqa_conv", dz, window, weight, bias, backward=True):
        return reference()
    return run_with_fallback(
        "ccgqa_conv",
        lambda: ccgqa_conv_bwd_launch(dz, window, weight, bias, zero_context, qk_mean_heads),
        reference,
    )


# --- torch.library registration ------------------------------------------------------------------


@torch.library.custom_op("hydra_kernels::ccgqa_conv_fwd", mutates_args=())
def _ccgqa_conv_fwd_op(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> torch.Tensor:
    return _ccgqa_conv_forward(window, weight, bias, zero_context, qk_mean_heads)


@_ccgqa_conv_fwd_op.register_fake
def _(window, weight, bias, zero_context=False, qk_mean_heads=0):
    g, k, d, _ = weight.shape
    rows = window.shape[1] if zero_context else window.shape[1] - k + 1
    return window.new_empty(window.shape[0], rows, g, d)


@torch.library.custom_op("hydra_kernels::ccgqa_conv_bwd", mutates_args=())
def _ccgqa_conv_bwd_op(
    dz: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ccgqa_conv_backward(dz, window, weight, bias, zero_context, qk_mean_heads)


@_ccgqa_conv_bwd_op.register_fake
def _(dz, window, weight, bias, zero_context=False, qk_mean_heads=0):
    # contiguous whatever the inputs' strides (a permuted weight, a strided window): what the
    # launcher and the reference return
    return window.new_empty(window.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _ccgqa_conv_setup(ctx, inputs, output) -> None:
    window, weight, bias, *flags = inputs
    ctx.save_for_backward(window, weight, bias)
    ctx.zero_context = bool(flags and flags[0])
    ctx.qk_mean_heads = int(flags[1]) if len(flags) > 1 else 0


def _ccgqa_conv_grads(ctx, dz):
    window, weight, bias = ctx.saved_tensors
    op = _ccgqa_conv_backward if getattr(ctx, "eager", False) else _ccgqa_conv_bwd_op
    grads = op(dz, window, weight, bias, ctx.zero_context, ctx.qk_mean_heads)
    return (*grads, None, None)


_ccgqa_conv_fwd_op.register_autograd(_ccgqa_conv_grads, setup_context=_ccgqa_conv_setup)
_CCGQAConvFunction = eager_autograd_function(
    "_CCGQAConvFunction", _ccgqa_conv_forward, _ccgqa_conv_setup, _ccgqa_conv_grads
)


# --- public function -----------------------------------------------------------------------------


def ccgqa_conv(
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    zero_context: bool = False,
    qk_mean_heads: int = 0,
) -> torch.Tensor:
    """CCGQA's folded conv stage: ``window`` [B, n + K − 1, C] (K − 1 rows of left context),
    ``weight`` [G, K, d, d] (per head and window offset an [out, in] matrix, G·d = C), ``bias``
    [C] → [B, n, G, d] in the window's dtype (autocast's dtype for an fp32 window under autocast,
    as the reference's einsum gives); differentiable in all three. ``zero_context``: ``window`` is
    [B, n, C] without its context rows, which are zeros (a sequence's start: the kernels mask them
    instead of reading a padded copy). ``qk_mean_heads`` = Q > 0: the first Q heads are queries,
    the rest keys, and CCGQA's q-k mean of each token's own channels is added (:func:`qk_mean_ref`;
    the module docstring). fp64, and shapes the kernels do not take (heads not in
    :data:`HEAD_DIMS`, fp32 heads wider than :data:`FP32_MAX_HEAD_DIM`, more than
    :data:`MAX_TAPS` taps), run the reference."""
    error = _shape_error(window, weight, bias, zero_context, qk_mean_heads)
    if error:
        raise ValueError(error)
    check_devices("ccgqa_conv", "window weight bias", window, weight, bias)
    device_type = window.device.type
    if window.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        # the reference's einsum would run in autocast's dtype: so do the kernels, on a cast copy
        window = window.to(torch.get_autocast_dtype(device_type))
    if _kernel_refusal(window, weight) or not controls.triton_path("ccgqa_conv", window, weight, bias):
        return ccgqa_conv_ref(window, weight, bias, zero_context, qk_mean_heads)
    if compiling():
        return _ccgqa_conv_fwd_op(window, weight, bias, zero_context, qk_mean_heads)
    return eager_apply(_CCGQAConvFunction, window, weight, bias, zero_context, qk_mean_heads)
