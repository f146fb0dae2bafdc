"""The transformers-specific parts of :func:`hydra_kernels.patch`: RoPE and the causal-LM loss.

No transformers import: everything is reached through the model's own classes and the modeling
modules that define them (a transformers model has imported them already).

**RoPE.** transformers' Llama-family modeling modules (Llama, Mistral, Qwen2, Qwen3, …) define a
module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` that the attention
forward calls by name, with q, k ``[B, H, S, D]`` (views of a ``[B, S, H, D]`` projection) and
cos/sin ``[B or 1, S, D]`` holding each frequency twice (rotate-half layout). Every modeling
module behind the model's classes that has such a function is probed: the function must compute
the rotate-half rotation on random inputs. Then the module's name is pointed at a wrapper that
runs :func:`hydra_kernels.rope` on ``q.transpose(1, 2)`` (a ``[B, S, H, D]`` view, read in place)
with the first half of cos/sin. A call it cannot take (another layout or signature) goes to the
original function and is counted (``patch_fallback_counts``).

**Loss.** A causal LM of a family whose head is a plain Linear (``PLAIN_HEAD_MODEL_TYPES``:
Llama, Mistral, Qwen2, Qwen3; ``lm_head`` without bias, the decoder under
``base_model_prefix``) gets an instance-level ``forward``: in training (``model.training`` and
gradients on) with ``labels`` it runs the decoder, then :func:`hydra_kernels.linear_cross_entropy`
on the final hidden states and ``lm_head.weight`` with the labels shifted as transformers'
``ForCausalLMLoss`` shifts them (``shift_labels`` and ``num_items_in_batch`` honoured), and
returns the loss with ``logits=None`` (as Liger does: the logits are what it saves). Anything
else (no labels, evaluation, generation) runs the original forward. Before it is installed, a
probe compares the fused loss with the original forward's on a few random tokens. Other
families are left alone (``record.skipped`` says so): logit scaling or soft-capping on random
weights can be too small for a probe to see.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import TYPE_CHECKING

import torch
from torch import nn

from hydra_kernels.ops.linear_cross_entropy import linear_cross_entropy
from hydra_kernels.ops.rope import rope, rope_ref

if TYPE_CHECKING:
    from hydra_kernels.patching import PatchRecord

ROPE_FUNCTION = "apply_rotary_pos_emb"
IGNORE_INDEX = -100


# --- RoPE -----------------------------------------------------------------------------------------


def _rotate_half_reference(q, k, cos, sin):
    """What a Llama-family apply_rotary_pos_emb computes, through hydra_kernels' reference."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    return tuple(rope_ref(t.transpose(1, 2), c, s).transpose(1, 2) for t in (q, k))


def _probe_rope(fn) -> bool:
    gen = torch.Generator().manual_seed(0x524F)
    b, hq, hk, s, d = 2, 4, 2, 5, 8
    q, k = torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hk, s, d, generator=gen)
    angles = torch.rand(b, s, d // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    try:
        with torch.no_grad():
            out = fn(q, k, cos, sin)
    except Exception:  # another signature: not the function this patch replaces
        return False
    expected = _rotate_half_reference(q, k, cos, sin)
    return (
        isinstance(out, tuple)
        and len(out) == 2
        and all(
            isinstance(o, torch.Tensor) and o.shape == e.shape and torch.allclose(o, e, atol=1e-5)
            for o, e in zip(out, expected, strict=True)
        )
    )


def _fused_rope(original):
    from hydra_kernels.patching import count_fallback

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        ok = (
            not args
            and set(kwargs) <= {"unsqueeze_dim", "position_ids"}
            and kwargs.get("unsqueeze_dim", 1) == 1
            and kwargs.get("position_ids") is None
            and q.dim() == 4
            and k.dim() == 4
            and cos.dim() == 3
            and cos.shape == sin.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1]
            and cos.shape[0] in (1, q.shape[0])
        )
        if not ok:
            count_fallback("rope", "a call other than (q, k [B, H, S, D], cos, sin [B, S, D])")
            return original(q, k, cos, sin, *args, **kwargs)
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        if c.shape[0] != q.shape[0]:
            c, s = c[0], s[0]  # [S, D/2], shared by the batch
        return rope(q.transpose(1, 2), c, s).transpose(1, 2), rope(k.transpose(1, 2), c, s).transpose(1, 2)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb.__hydra_patched__ = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def patch_rotary_functions(model: nn.Module, record: PatchRecord) -> None:
    """Point each probed ``apply_rotary_pos_emb`` of the model's modeling modules at the kernel."""
    from hydra_kernels.patching import Replacement

    seen: set[str] = set()
    for module in model.modules():
        name = type(module).__module__
        if name in seen:
            continue
        seen.add(name)
        pymod = sys.modules.get(name)
        fn = getattr(pymod, ROPE_FUNCTION, None)
        if not callable(fn) or getattr(fn, "__hydra_patched__", False):
            continue
        if not _probe_rope(fn):
            record.skipped.append((f"{name}.{ROPE_FUNCTION}", "does not compute rotate-half RoPE"))
            continue
        setattr(pymod, ROPE_FUNCTION, _fused_rope(fn))

        def put_back(pymod: types.ModuleType = pymod, fn=fn) -> None:
            setattr(pymod, ROPE_FUNCTION, fn)

        record.add(Replacement(f"{name}.{ROPE_FUNCTION}", ROPE_FUNCTION, "rope"), put_back)


# --- the causal-LM loss ---------------------------------------------------------------------------


def _output_class(model: nn.Module):
    return getattr(sys.modules.get(type(model).__module__), "CausalLMOutputWithPast", None)


#: model types whose causal-LM head is a plain bias-free Linear and whose loss is ForCausalLMLoss
#: (read in their transformers modeling code); others may scale or soft-cap their logits, which a
#: probe on random weights cannot tell from nothing
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _is_causal_lm(module: nn.Module) -> str | None:
    """None when ``module`` has a causal LM's structure, else why not."""
    kind = getattr(getattr(module, "config", None), "model_type", None)
    if kind not in PLAIN_HEAD_MODEL_TYPES:
        known = ", ".join(PLAIN_HEAD_MODEL_TYPES)
        return f"model_type {kind!r} is not one with a known plain LM head ({known})"
    head = getattr(module, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return "no lm_head Linear"
    if head.bias is not None:
        return "lm_head has a bias"
    if not isinstance(getattr(module, getattr(module, "base_model_prefix", ""), None), nn.Module):
        return "no decoder under base_model_prefix"
    if not callable(getattr(module, "loss_function", None)):
        return "no loss_function"
    if _output_class(module) is None:
        return "its modeling module has no CausalLMOutputWithPast"
    return None


def _shifted_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _fused_loss(model: nn.Module, hidden: torch.Tensor, labels, shift_labels, num_items) -> torch.Tensor:
    targets = _shifted_targets(labels, shift_labels).to(hidden.device)
    weight = model.lm_head.weight
    if num_items is None:
        return linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX, "mean")
    total = linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX, "sum")
    return total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)


def _fused_forward(original, signature: inspect.Signature):
    from hydra_kernels.patching import count_fallback

    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def forward(self, *args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # let the original raise its own error
            return original(*args, **kwargs)
        call = {**bound, **(bound.pop(var_kw, None) or {})} if var_kw else dict(bound)
        labels = call.pop("labels", None)
        if labels is None or not (self.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if call.get("return_dict") is False:
            count_fallback("linear_cross_entropy", "return_dict=False")
            return original(*args, **kwargs)
        call.pop("logits_to_keep", None)
        shift_labels, num_items = call.pop("shift_labels", None), call.pop("num_items_in_batch", None)
        outputs = getattr(self, self.base_model_prefix)(**call)
        loss = _fused_loss(self, outputs[0], labels, shift_labels, num_items)
        cls = _output_class(self)
        fields = cls.__dataclass_fields__
        passed = {k: v for k, v in outputs.items() if k != "last_hidden_state" and k in fields}
        return cls(loss=loss, logits=None, **passed)

    forward.__hydra_patched__ = True  # type: ignore[attr-defined]
    return forward


def _probe_loss(model: nn.Module) -> bool:
    """The fused loss equals the original forward's on a few random tokens (eval, no grad)."""
    head = model.lm_head.weight
    if head.device.type == "meta":
        return False
    gen = torch.Generator().manual_seed(0x4C4D)
    ids = torch.randint(0, head.shape[0], (1, 8), generator=gen).to(head.device)
    labels = ids.clone()
    labels[0, 2] = IGNORE_INDEX
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model.forward(input_ids=ids, labels=labels).loss
            outputs = getattr(model, model.base_model_prefix)(input_ids=ids)
            got = _fused_loss(model, outputs[0], labels, None, None)
    except Exception:
        return False
    finally:
        model.train(was)
    tol = 1e-4 if head.dtype == torch.float32 else 2e-2
    return bool(torch.isfinite(got)) and abs(float(got) - float(want)) <= tol * max(1.0, abs(float(want)))


def patch_causal_lm_loss(model: nn.Module, record: PatchRecord) -> None:
    """Give every causal LM in ``model`` (itself included) the fused training loss."""
    from hydra_kernels.patching import Replacement

    for name, module in model.named_modules():
        if "forward" in module.__dict__ or not hasattr(module, "lm_head"):
            continue  # already patched, or not a language model at all
        why = _is_causal_lm(module)
        if why is None and not _probe_loss(module):
            why = "the fused loss differs from its forward's loss (a head that is not plain linear)"
        if why is not None:
            record.skipped.append((name or type(module).__name__, why))
            continue
        original = module.forward
        fused = _fused_forward(original, inspect.signature(original))
        module.forward = types.MethodType(fused, module)

        def put_back(module: nn.Module = module) -> None:
            module.__dict__.pop("forward", None)

        record.add(
            Replacement(name or "", f"{type(module).__name__}.forward", "linear_cross_entropy"), put_back
        )


__all__ = ["PLAIN_HEAD_MODEL_TYPES", "patch_causal_lm_loss", "patch_rotary_functions"]
