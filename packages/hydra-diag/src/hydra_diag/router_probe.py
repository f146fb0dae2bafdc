"""Router logits seen from outside the model, through forward hooks on the public block classes.

The model reports per-layer averages (``routing_stats``); collapse shows in the *spread* of router
scores across tokens, which averages hide. The probe records, per forward:

* MoD (``CCGQAMoDBlockWrapper.router``, one logit per token) and MoR recursion 0
  (``CCGQAMoRBlock.router`` row 0): the logits recomputed from the router's weights on the block's
  input, ``w·rmsnorm(h) + b``, which is how hydra-model documents its routers;
* MoE (``MoEFFN``): the router's softmax over experts for every row the layer saw, and the expert
  each real row picked (``valid`` rows only; the selection rule of :mod:`hydra_model.moe`: top-k of
  the softmax, plus the balance bias under loss-free balancing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


def _first_tensor(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs[name]


def rms_scored(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``w·rmsnorm(h) + b`` in fp32 for h [..., E], w [E] → [...]."""
    hf = F.rms_norm(h.float(), (h.shape[-1],), eps=1e-6)
    out = hf @ weight.float()
    return out + bias.float() if bias is not None else out


def snapshot_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every buffer: a training-mode forward updates some (loss-free MoE bias, pending
    load, statistics), and a diagnostic must leave the model as it found it."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in saved and saved[n].shape == b.shape:
                b.copy_(saved[n])


@dataclass
class LayerScores:
    """Scores of one router over every forward the probe saw (on the CPU)."""

    logits: list[torch.Tensor] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.logits:
            return {}
        z = torch.cat([t.reshape(-1) for t in self.logits])
        p = torch.sigmoid(z)
        return {
            "logit_mean": float(z.mean()),
            "logit_std": float(z.std()) if z.numel() > 1 else 0.0,
            "frac_above_half": float((z > 0).float().mean()),
            "frac_saturated": float(((p < 0.01) | (p > 0.99)).float().mean()),
            "tokens": int(z.numel()),
        }


@dataclass
class ExpertChoices:
    """Per MoE layer: router probabilities and chosen experts of the real rows, per call."""

    n_experts: int
    top_k: int
    probs: list[torch.Tensor] = field(default_factory=list)  # [T, E] real rows
    chosen: list[torch.Tensor] = field(default_factory=list)  # [T, k]
    in_order: list[bool] = field(default_factory=list)  # rows are the batch's tokens in order

    def counts(self) -> torch.Tensor:
        if not self.chosen:
            return torch.zeros(self.n_experts)
        flat = torch.cat([c.reshape(-1) for c in self.chosen])
        return torch.bincount(flat, minlength=self.n_experts).float()


class RouterProbe:
    """Context manager adding the hooks to ``model``; read ``mod``, ``mor``, ``moe`` afterwards."""

    def __init__(self, model: torch.nn.Module, batch_tokens: int | None = None):
        from hydra_model import CCGQAMoDBlockWrapper, CCGQAMoRBlock, MoEFFN

        self.model = model
        self.batch_tokens = batch_tokens  # B·S of the forward being probed (marks in-order rows)
        self.mod: dict[int, LayerScores] = {}
        self.mor: dict[int, LayerScores] = {}
        self.moe: dict[int, ExpertChoices] = {}
        self._handles: list[Any] = []
        self._types = (CCGQAMoDBlockWrapper, CCGQAMoRBlock, MoEFFN)

    def __enter__(self) -> RouterProbe:
        wrapper_t, mor_t, moe_t = self._types
        for i, blk in enumerate(self.model.blocks):
            if isinstance(blk, wrapper_t) and getattr(blk, "router", None) is not None:
                self.mod[i] = LayerScores()
                self._handles.append(blk.register_forward_pre_hook(self._mod_hook(i), with_kwargs=True))
            mor = getattr(blk, "mor", None)
            if isinstance(mor, mor_t) and getattr(mor, "router", None) is not None:
                self.mor[i] = LayerScores()
                self._handles.append(mor.register_forward_pre_hook(self._mor_hook(i), with_kwargs=True))
            for mod in blk.modules():
                if isinstance(mod, moe_t):
                    self.moe[i] = ExpertChoices(mod.n_experts, mod.top_k)
                    self._handles.append(mod.register_forward_pre_hook(self._moe_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _mod_hook(self, i: int):
        def hook(module, args, kwargs):
            h = _first_tensor(args, kwargs, "h")
            w, b = module.router.weight[0], module.router.bias
            with torch.no_grad():
                self.mod[i].logits.append(rms_scored(h, w, None if b is None else b[0]).cpu())

        return hook

    def _mor_hook(self, i: int):
        def hook(module, args, kwargs):
            h = _first_tensor(args, kwargs, "h")
            member = args[2] if len(args) > 2 else kwargs.get("member")
            w = module.router.weight[0]
            b = module.router.bias[0] if module.router.bias is not None else None
            with torch.no_grad():
                z = rms_scored(h, w, b)
                if member is not None:
                    z = z[member]
                self.mor[i].logits.append(z.cpu())

        return hook

    def _moe_hook(self, i: int):
        def hook(module, args, kwargs):
            x = _first_tensor(args, kwargs, "x")
            valid = args[1] if len(args) > 1 else kwargs.get("valid")
            with torch.no_grad():
                xf = x.reshape(-1, module.dim)
                probs = module.router(xf).float().softmax(-1)
                scores = probs + module.balance_bias if module.balancing == "loss_free" else probs
                chosen = scores.topk(module.top_k, dim=-1).indices
                in_order = (
                    valid is None and self.batch_tokens is not None and xf.shape[0] == self.batch_tokens
                )
                if valid is not None:
                    keep = valid.reshape(-1)
                    probs, chosen = probs[keep], chosen[keep]
                rec = self.moe[i]
                rec.probs.append(probs.cpu())
                rec.chosen.append(chosen.cpu())
                rec.in_order.append(bool(in_order))

        return hook
