"""``patch(model)``: swap the fused ops into an existing model, in place, and say what changed.

Four kinds of replacement, each decided by what a module *computes* (a numerical probe against
the hydra_kernels reference), not by its class name, so stock Hugging Face models (Llama,
Mistral, Qwen2, Qwen3) and any module with the same maths are covered alike:

* ``rms_norm``: an RMSNorm leaf module becomes :class:`~hydra_kernels.HydraRMSNorm` (modules.py);
* ``swiglu_mlp``: a ``gate_proj`` / ``up_proj`` / ``down_proj`` MLP computing
  ``down(silu(gate(x)) · up(x))`` becomes :class:`PatchedSwiGLUMLP` on the *same* Linear modules
  (state-dict keys, ties and optimizer references unchanged) with the fused SwiGLU between;
* ``rope``: a transformers modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)`` becomes
  the fused RoPE kernel (patching_hf.py);
* ``linear_cross_entropy``: a causal LM's training forward with labels computes its loss with
  :func:`~hydra_kernels.linear_cross_entropy` straight from the final hidden states, without the
  [tokens, vocab] logits (patching_hf.py).

:func:`patch` returns a :class:`PatchRecord`: one :class:`Replacement` per change, what was
considered and left alone (``skipped``, with the reason), and :meth:`PatchRecord.undo`. Nothing
here imports transformers: a model of it has already imported it, and the patch finds its pieces
through the model's own modules.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels.ops.swiglu import swiglu

KINDS = ("rms_norm", "swiglu_mlp", "rope", "linear_cross_entropy")

_fallbacks: Counter[str] = Counter()
_warned: set[str] = set()


def patch_fallback_counts() -> dict[str, int]:
    """Calls a patched function handed back to the original since import (a call shape the fused
    path does not take), per kind; each kind also warns once when it first happens."""
    return dict(_fallbacks)


def count_fallback(kind: str, why: str) -> None:
    _fallbacks[kind] += 1
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(
            f"hydra_kernels.patch: a {kind} call ran the original code ({why}); "
            "counted in patch_fallback_counts()",
            RuntimeWarning,
            stacklevel=3,
        )


class Replacement(NamedTuple):
    """One change: ``where`` (qualified module name, or ``module.function`` for a function),
    ``original`` (the class or function it replaced) and ``kind`` (one of :data:`KINDS`)."""

    where: str
    original: str
    kind: str


@dataclass
class PatchRecord:
    """What :func:`patch` replaced (``replaced``), what it looked at and left (``skipped``:
    ``(where, reason)``), and how to put everything back (:meth:`undo`)."""

    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def __iter__(self):
        return iter(self.replaced)

    def __len__(self) -> int:
        return len(self.replaced)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PatchRecord):
            return self.replaced == other.replaced
        return isinstance(other, list) and self.replaced == other

    def of_kind(self, kind: str) -> list[Replacement]:
        return [r for r in self.replaced if r.kind == kind]

    def counts(self) -> dict[str, int]:
        return {k: len(self.of_kind(k)) for k in KINDS}

    def add(self, replacement: Replacement, undo: Callable[[], None]) -> None:
        self.replaced.append(replacement)
        self._undo.append(undo)

    def undo(self) -> None:
        """Restore every original module, function and forward, newest change first."""
        while self._undo:
            self._undo.pop()()
        self.replaced.clear()


# --- module swaps ---------------------------------------------------------------------------------


def swap_modules(
    model: nn.Module, kind: str, decide: Callable[[nn.Module], nn.Module | None], record: PatchRecord
) -> None:
    """Replace each child module (at any depth; never the root) for which ``decide`` returns a new
    module. A module shared by several parents is decided once and replaced everywhere."""
    decided: dict[int, nn.Module | None] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            if id(child) not in decided:
                decided[id(child)] = decide(child)
            new = decided[id(child)]
            if new is None:
                continue
            setattr(parent, child_name, new)
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name

            def put_back(parent: nn.Module = parent, name: str = child_name, old: nn.Module = child) -> None:
                setattr(parent, name, old)

            record.add(Replacement(qualified, type(child).__name__, kind), put_back)


def _no_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


# --- SwiGLU MLP -----------------------------------------------------------------------------------


class PatchedSwiGLUMLP(nn.Module):
    """``down_proj(swiglu(gate_proj(x), up_proj(x)))`` on the replaced MLP's own Linear modules
    (so its state-dict keys, tied or shared weights and optimizer state are unchanged)."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def _swiglu_candidate(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """The three Linears of a module that could be a SwiGLU MLP: children gate_proj, up_proj,
    down_proj (Linears of matching shapes) and at most a parameter-free activation, no own
    parameters or buffers, no hooks."""
    if isinstance(module, PatchedSwiGLUMLP) or not _no_hooks(module):
        return None
    children = dict(module.named_children())
    linears = [children.get(n) for n in _MLP_LINEARS]
    if not all(isinstance(m, nn.Linear) and _no_hooks(m) for m in linears):
        return None
    others = [m for n, m in children.items() if n not in _MLP_LINEARS]
    if len(others) > 1 or any(list(m.parameters()) or list(m.buffers()) for m in others):
        return None
    if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
        return None
    gate, up, down = linears
    if gate.weight.shape != up.weight.shape or down.weight.shape[::-1] != gate.weight.shape:
        return None
    return gate, up, down


#: a decision per (class, activation, plain attributes) once probed: a model's layers share them
_mlp_probe_cache: dict[tuple[Any, ...], bool] = {}


def _computes_swiglu(module: nn.Module, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> bool:
    """Probe in fp32 with random stand-in weights: does its forward equal down(silu(gate)·up)?
    Not the module's own weights: a zero (or otherwise degenerate) projection, as some inits
    leave it, makes every activation look alike, and the decision is cached per class."""
    device = gate.weight.device
    if device.type == "meta":
        return False
    act = next((m for n, m in module.named_children() if n not in _MLP_LINEARS), None)
    # the plain attributes too (an activation held as a function, a config): instances of one
    # class may compute differently, and the class alone would hand one's decision to the other
    plain = tuple(sorted((k, repr(v)) for k, v in vars(module).items() if not k.startswith("_")))
    key = (type(module), type(act), repr(act), plain)
    if key in _mlp_probe_cache:
        return _mlp_probe_cache[key]
    gen = torch.Generator().manual_seed(0x5157)
    x = torch.randn(3, gate.in_features, generator=gen).to(device) * 2.0
    params = {
        n: (torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5).to(device)
        for n, p in module.named_parameters()
    }
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, params, (x,))
    except Exception:  # wants other arguments: not an MLP we can swap
        _mlp_probe_cache[key] = False
        return False
    with torch.no_grad():
        g = F.linear(x, params["gate_proj.weight"], params.get("gate_proj.bias"))
        u = F.linear(x, params["up_proj.weight"], params.get("up_proj.bias"))
        expected = F.linear(F.silu(g) * u, params["down_proj.weight"], params.get("down_proj.bias"))
    ok = isinstance(out, torch.Tensor) and out.shape == expected.shape
    ok = ok and bool(torch.allclose(out, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max() + 1)))
    _mlp_probe_cache[key] = ok
    return ok


def swiglu_replacement(module: nn.Module) -> nn.Module | None:
    found = _swiglu_candidate(module)
    if found is None or not _computes_swiglu(module, *found):
        return None
    new = PatchedSwiGLUMLP(*found)
    new.train(module.training)
    return new


# --- patch() --------------------------------------------------------------------------------------


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    swiglu_mlp: bool = True,
    rope: bool = True,
    linear_cross_entropy: bool = True,
) -> PatchRecord:
    """Swap the fused hydra_kernels ops into ``model`` in place (see the module docstring) and
    return the :class:`PatchRecord`. Each keyword switches one kind off. Idempotent: a second
    call finds nothing more to replace. ``rope`` changes a function of a transformers modeling
    module, so it holds for every model of that family in the process (the same maths), until
    ``record.undo()``."""
    from hydra_kernels.modules import rms_norm_replacement
    from hydra_kernels.patching_hf import patch_causal_lm_loss, patch_rotary_functions

    record = PatchRecord()
    if rms_norm:
        fallback = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        swap_modules(model, "rms_norm", lambda m: rms_norm_replacement(m, fallback), record)
    if swiglu_mlp:
        swap_modules(model, "swiglu_mlp", swiglu_replacement, record)
    if rope:
        patch_rotary_functions(model, record)
    if linear_cross_entropy:
        patch_causal_lm_loss(model, record)
    return record
