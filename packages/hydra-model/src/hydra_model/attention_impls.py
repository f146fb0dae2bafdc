"""The attention backends flexible_attention runs, all on [B, H, S, d]: PyTorch's SDPA (optionally
restricted to one of its kernels, or with K/V expanded to the query heads), flash-attn and
xformers where importable, and why one of them cannot run given inputs.

Separate from ``attention_backend.py``, which chooses among them (auto's measuring and its cached
picks, the fallbacks and their counts) and re-exports what it uses of this module, among them
``FLASH_ATTN_AVAILABLE`` and ``XFORMERS_AVAILABLE``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hydra_model.options import OPTIONS

try:  # pragma: no cover - flash-attn is not installed on the project's machines
    from flash_attn import flash_attn_func as _flash_attn_func

    FLASH_ATTN_AVAILABLE = True
except Exception:
    _flash_attn_func = None
    FLASH_ATTN_AVAILABLE = False

try:  # pragma: no cover - xformers is not installed on the project's machines
    import xformers.ops as _xops

    XFORMERS_AVAILABLE = True
except Exception:
    _xops = None
    XFORMERS_AVAILABLE = False

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - torch < 2.3
    SDPBackend = None
    sdpa_kernel = None


def _sdpa_kernels(restrict: str | None) -> list | None:
    if SDPBackend is None or restrict == "none":
        return None
    if restrict == "cudnn":
        return [SDPBackend.CUDNN_ATTENTION]
    if restrict == "flash" or OPTIONS.sdpa_flash_only:
        return [SDPBackend.FLASH_ATTENTION]
    if restrict == "efficient":
        return [SDPBackend.EFFICIENT_ATTENTION]
    if OPTIONS.sdpa_no_flash:
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return None


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    groups = q.shape[1] // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _run_sdpa(q, k, v, causal, mask, scale, restrict: str | None = None, expand: bool = False):
    if expand:
        k, v = _expand_kv(q, k), _expand_kv(q, v)
    # a branch, not bool(): where a trace's head counts are symbolic, SDPA's flag must be a bool
    gqa = True if q.shape[1] != k.shape[1] else False  # noqa: SIM210
    kernels = _sdpa_kernels(restrict)
    ctx = sdpa_kernel(kernels) if kernels is not None else contextlib.nullcontext()
    with ctx:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )


def _run_flash(q, k, v, causal, mask, scale):
    # flash-attn takes [B, S, H, d] and grouped kv heads natively
    out = _flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale
    )
    return out.transpose(1, 2)


def _run_xformers(q, k, v, causal, mask, scale):
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = hq // hkv
    # grouped layout [B, S, Hkv, G, d]; kv broadcast over G by a stride-0 expand (no copy)
    qx = q.transpose(1, 2).reshape(b, s, hkv, groups, d)
    kx = k.transpose(1, 2).unsqueeze(3).expand(b, length, hkv, groups, d)
    vx = v.transpose(1, 2).unsqueeze(3).expand(b, length, hkv, groups, d)
    bias = _xops.LowerTriangularMask() if causal else None
    out = _xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, scale=scale)
    return out.reshape(b, s, hq, d).transpose(1, 2)


def _invalid_reason(name: str, q: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Why backend ``name`` cannot run these inputs, or None when it can."""
    if name == "flash":
        if not FLASH_ATTN_AVAILABLE:
            return "not installed"
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return "needs fp16/bf16 CUDA tensors"
        if q.shape[-1] % 8 or q.shape[-1] > 256 or mask is not None:
            return "head size or mask not supported"
    if name == "xformers":
        if not XFORMERS_AVAILABLE:
            return "not installed"
        if q.device.type != "cuda" or mask is not None:
            return "needs CUDA tensors and no explicit mask"
    return None
