"""``nn.Module`` faces of the fused ops, and the RMSNorm part of :func:`hydra_kernels.patch`.

One section per op family. :func:`hydra_kernels.patch` itself (every kind of replacement, the
record, undo) is in patching.py.
"""

from __future__ import annotations

import torch
from torch import nn

from hydra_kernels.ops.linear_cross_entropy import REDUCTIONS, linear_cross_entropy
from hydra_kernels.ops.rms_norm import rms_norm, rms_norm_ref
from hydra_kernels.ops.swiglu import swiglu_packed

# =================================================================================================
# RMSNorm: HydraRMSNorm, and the RMSNorm part of patch() (rms_norm_replacement)
# =================================================================================================


class HydraRMSNorm(nn.Module):
    """RMSNorm over the last dimension through :func:`hydra_kernels.rms_norm` (fused Triton
    forward and backward where available, the PyTorch reference elsewhere).

    Drop-in for ``torch.nn.RMSNorm(dim)``, whose one-dim ``normalized_shape`` (``[768]``) it also
    takes: same ``weight`` parameter and state-dict key. ``eps`` None means
    ``torch.finfo(x.dtype).eps`` at call time, as in ``torch.nn.RMSNorm``. Without an affine
    weight the kernel multiplies by a non-persistent buffer of ones.
    """

    def __init__(
        self,
        dim: int | list[int] | tuple[int, ...],
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dim, (list, tuple)):  # torch.nn.RMSNorm's normalized_shape: [dim], (dim,), Size
            if len(dim) != 1:
                raise ValueError(
                    f"HydraRMSNorm: normalized_shape {tuple(dim)} has {len(dim)} dims; only the last "
                    "dim is normalised here, pass it alone (e.g. HydraRMSNorm(768))"
                )
            dim = int(dim[0])
        if dim < 1:
            raise ValueError(f"HydraRMSNorm: dim must be positive, got {dim}")
        self.normalized_shape = (int(dim),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_buffer(
                "_unit_weight", torch.ones(dim, device=device, dtype=dtype), persistent=False
            )

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight is not None else self._unit_weight
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, weight, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


#: Attribute names under which RMSNorm implementations keep their epsilon.
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")

# Row scales of the probe input: from ordinary activations down to rows whose mean square is
# comparable to epsilons between 1e-8 and 1e-4, so that a different epsilon shows.
_PROBE_ROW_SCALES = (1.0, 10.0, 1e-2, 1e-3, 3e-4, 1e-4)


def _rms_norm_candidate(module: nn.Module) -> tuple[int, float | None, nn.Parameter | None] | None:
    """(dim, eps, weight) when ``module`` could be an RMSNorm that :class:`HydraRMSNorm` can
    replace losslessly — one 1-D weight (or none for ``nn.RMSNorm``), an epsilon attribute, no
    other state, no children, no hooks — else None. Whether the math matches is probed later."""
    if isinstance(module, HydraRMSNorm) or any(True for _ in module.children()):
        return None
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None  # replacing the module would silently drop them
    if list(module.buffers(recurse=False)):
        return None
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1 or set(params) - {"weight"}:
            return None
        return module.normalized_shape[0], module.eps, module.weight
    if set(params) != {"weight"}:
        return None
    weight = params["weight"]
    if weight.dim() != 1 or not weight.is_floating_point():
        return None
    for name in _EPS_ATTRS:
        eps = getattr(module, name, None)
        if isinstance(eps, (float, int)) and not isinstance(eps, bool):
            return weight.shape[0], float(eps), weight
    return None


def _computes_rms_norm(
    module: nn.Module, dim: int, eps: float | None, weight: nn.Parameter | None, device: torch.device
) -> bool:
    """Probe: run ``module`` (with a random stand-in weight) on a random fp32 input whose rows
    span several magnitudes, and compare with the RMSNorm reference at the module's epsilon."""
    if device.type == "meta":
        return False
    gen = torch.Generator().manual_seed(0x4859)
    scales = torch.tensor(_PROBE_ROW_SCALES).unsqueeze(-1)
    x = (torch.randn(len(_PROBE_ROW_SCALES), dim, generator=gen) * scales).to(device)
    probe_weight = (1.0 + 0.5 * torch.randn(dim, generator=gen)).to(device)
    params = {"weight": probe_weight} if weight is not None else {}
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, params, (x,))
    except Exception:  # a forward that wants other arguments is not an RMSNorm we can swap
        return False
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return False
    expected = rms_norm_ref(
        x.double(),
        (probe_weight if weight is not None else torch.ones_like(probe_weight)).double(),
        eps if eps is not None else torch.finfo(torch.float32).eps,
    )
    return bool(torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-5))


def rms_norm_replacement(module: nn.Module, fallback_device: torch.device) -> HydraRMSNorm | None:
    """The :class:`HydraRMSNorm` that computes what ``module`` computes, sharing its ``weight``
    Parameter (optimizers and ties keep working), or None when ``module`` is not such an RMSNorm
    (used by :func:`hydra_kernels.patch`; ``fallback_device`` probes a norm without a weight)."""
    found = _rms_norm_candidate(module)
    if found is None:
        return None
    dim, eps, weight = found
    device = weight.device if weight is not None else fallback_device
    if not _computes_rms_norm(module, dim, eps, weight, device):
        return None
    new = HydraRMSNorm(
        dim,
        eps=eps,
        elementwise_affine=weight is not None,
        device=device,
        dtype=weight.dtype if weight is not None else None,
    )
    if weight is not None:
        new.weight = weight  # the same Parameter: optimizers and ties keep working
    new.train(module.training)
    return new


# =================================================================================================
# SwiGLU: HydraSwiGLUMLP
# =================================================================================================


def default_swiglu_hidden(dim: int, multiple_of: int = 64) -> int:
    """The usual SwiGLU width: 8/3 of ``dim`` (the parameters of a 4x GELU MLP), rounded up to a
    multiple of ``multiple_of``."""
    return -(-int(8 * dim / 3) // multiple_of) * multiple_of


class HydraSwiGLUMLP(nn.Module):
    """``down(silu(x·W_gateᵀ) * (x·W_upᵀ))`` with the gate and up projections fused into one
    ``Linear(dim, 2·hidden_dim)`` (gate rows first, then up rows) and the fused SwiGLU between.

    ``hidden_dim`` defaults to :func:`default_swiglu_hidden`. The fused projection's output goes
    whole to :func:`hydra_kernels.swiglu_packed`, so its gradient comes back as one tensor
    written by one kernel (two slices would make autograd zero-fill and add two full-size
    gradients).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int | None = None,
        bias: bool = False,
        *,
        multiple_of: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"HydraSwiGLUMLP: dim must be positive, got {dim}")
        hidden = default_swiglu_hidden(dim, multiple_of) if hidden_dim is None else hidden_dim
        if hidden < 1:
            raise ValueError(f"HydraSwiGLUMLP: hidden_dim must be positive, got {hidden}")
        self.dim = dim
        self.hidden_dim = hidden
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2H]
        return self.down_proj(swiglu_packed(gate_up))  # [..., H] -> [..., D]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}"


# =================================================================================================
# Linear + cross-entropy: HydraLinearCrossEntropyLoss
# =================================================================================================


class HydraLinearCrossEntropyLoss(nn.Module):
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without the full logits.

    ``forward(hidden [..., D], weight [V, D], targets [...])`` runs
    :func:`~hydra_kernels.linear_cross_entropy`. The weight is an argument, not a parameter of
    this module, so a tied LM head (the embedding matrix) needs no copy. ``z_loss`` adds
    ``z_loss · logsumexp²`` per non-ignored token.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", z_loss: float = 0.0) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"HydraLinearCrossEntropyLoss: reduction must be one of {', '.join(REDUCTIONS)}, "
                f"got {reduction!r}"
            )
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.z_loss = float(z_loss)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, targets, self.ignore_index, self.reduction, self.z_loss)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, z_loss={self.z_loss}"
