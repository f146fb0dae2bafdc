"""Routing rules: how a MoD routing point and a MoR block pick their tokens, one class per rule,
registered by name.

A rule is a :class:`RoutingRule` subclass decorated with :func:`register_routing`. Its name is
what a block's ``mode`` holds (MoR) or what ``HydraConfig.routing`` names (MoD and MoR token
selection; rules with ``selects_tokens = True`` are the values that field accepts). The blocks
(blocks.py) build the rule's submodules once (``build_mod``/``build_mor``: routers, thresholds)
and call its forward; nothing else names the rules. The registered ones:

==============  ==================================  =========================================
rule            training (model.train())            eval / decoding (model.eval())
==============  ==================================  =========================================
causal          threshold + causal budget,          the same rule, the same gather (a decode
(the default)   gathered into ⌈c·S⌉ rows            step skips what its token is routed out of)
expert_choice   top-k per sequence (sees the        causal threshold (σ(logit) > ½) over a
(ablation)      future), gathered in time order     selected-first permutation of all rows
static          soft: every token, update × weight  same as training (already causal)
token_choice    MoR depth chosen per token up front same as training (already causal)
dense           no routers, every token everywhere  same
==============  ==================================  =========================================

Updates are scaled by the router weight (MoD: σ(logit); MoR: α·σ(logit)) so routers learn from
the LM loss. Causal routing (causal_routing.py) needs nothing more; expert choice adds a BCE
auxiliary loss that teaches the routers to predict top-k membership from the token alone, which
its evaluation threshold relies on.

To add a rule: subclass RoutingRule, set ``name`` (and ``selects_tokens`` if ``routing=`` may name
it), implement ``mod_forward`` and/or ``mor_forward`` (and ``build_*`` for its own modules),
decorate it with ``@register_routing``; test causality and the agreement of training and
evaluation as tests/hydra_model/test_causal_routing.py does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from hydra_model.fused_routing import gated_mix, router_logits
from hydra_model.routing import SubSequence, masked_mean, positions_or_arange

if TYPE_CHECKING:
    from hydra_model.blocks import CCGQAMoDBlockWrapper, CCGQAMoRBlock, RunContext
    from hydra_model.config import HydraConfig

AuxLists = dict[str, list[torch.Tensor]]
#: what a MoR rule returns: the new stream, each token's depth and its expected depth ([B, n]);
#: the depths are None where there are no statistics to record (a generation, the dense rule)
MoRResult = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def add_aux(aux: AuxLists, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        aux.setdefault(name, []).append(value)


def merge_aux(into: AuxLists, other: AuxLists) -> None:
    for name, values in other.items():
        into.setdefault(name, []).extend(values)


def router_input(h: torch.Tensor) -> torch.Tensor:
    """Routers score the RMS-normalised residual stream: its scale grows with depth and starts at
    the embedding's (≈ 0.02), which would leave every initial logit near 0 and every σ near ½."""
    return F.rms_norm(h, (h.shape[-1],), eps=1e-6)


class RoutingRule:
    """One way of routing tokens (see the module docstring). Instances are stateless: the state
    (routers, thresholds, statistics) lives on the blocks."""

    name: ClassVar[str] = ""
    #: a value of ``HydraConfig.routing``: the rule decides which tokens MoD and MoR take
    selects_tokens: ClassVar[bool] = False

    def build_mod(self, wrapper: CCGQAMoDBlockWrapper, cfg: HydraConfig) -> None:
        """Create this rule's submodules on a routed MoD wrapper (before its MoR block and router)."""

    def build_mor(self, block: CCGQAMoRBlock, cfg: HydraConfig, parent_capacity: float) -> None:
        """Create this rule's submodules on a MoR block (its ``router`` exists unless dense)."""

    def mod_forward(
        self, wrapper: CCGQAMoDBlockWrapper, h: torch.Tensor, pos: torch.Tensor | None, ctx: RunContext
    ) -> tuple[torch.Tensor, AuxLists]:
        raise ValueError(f"routing rule {self.name!r} does not route Mixture-of-Depths blocks")

    #: the rule splits a MoD decode step into ``decode_decide`` and ``decode_apply`` (see
    #: routing_causal.py), so a graphed decoder can skip the block for a token routed out of it
    #: (decode_graphs.py); otherwise a graphed step runs the whole ``mod_forward``
    staged_decode: ClassVar[bool] = False

    def decode_decide(self, wrapper, h, pos, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"routing rule {self.name!r} has no staged decode step")

    def decode_decide_into(self, wrapper, h, pos, ctx, taken, weight, flag) -> None:
        """:meth:`decode_decide` written into a staged decoder's buffers (decode_graphs.py): taken
        [B, 1] bool, weight [B, 1] and flag [] bool = any token taken (a rule may write them
        itself, as the causal rule's fused kernel does)."""
        now, w = self.decode_decide(wrapper, h, pos, ctx)
        taken.copy_(now)
        weight.copy_(w)
        flag.copy_(now.any())

    def decode_apply(self, wrapper, h, pos, ctx, taken, weight) -> tuple[torch.Tensor, AuxLists]:
        raise NotImplementedError(f"routing rule {self.name!r} has no staged decode step")

    def decode_apply_into(self, wrapper, h, pos, ctx, taken, weight) -> None:
        """:meth:`decode_apply`'s new h written into the stream buffer h (a gated decode stage)."""
        h.copy_(self.decode_apply(wrapper, h, pos, ctx, taken, weight)[0])

    def mor_forward(
        self,
        block: CCGQAMoRBlock,
        h: torch.Tensor,
        pos: torch.Tensor | None,
        member: torch.Tensor | None,
        ctx: RunContext,
        aux: AuxLists,
    ) -> MoRResult:
        raise ValueError(f"routing rule {self.name!r} does not route Mixture-of-Recursions blocks")


ROUTING_RULES: dict[str, RoutingRule] = {}


def register_routing(cls: type[RoutingRule]) -> type[RoutingRule]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name or cls.name in ROUTING_RULES:
        raise ValueError(f"routing rule {cls.__name__}: name {cls.name!r} is empty or taken")
    ROUTING_RULES[cls.name] = cls()
    return cls


def routing_rule(name: str) -> RoutingRule:
    try:
        return ROUTING_RULES[name]
    except KeyError:
        raise ValueError(f"unknown routing rule {name!r}; registered: {', '.join(ROUTING_RULES)}") from None


def token_selection_rules() -> tuple[str, ...]:
    """The names ``HydraConfig.routing`` accepts."""
    return tuple(n for n, r in ROUTING_RULES.items() if r.selects_tokens)


def soft_mod(wrapper: CCGQAMoDBlockWrapper, h: torch.Tensor, pos, ctx) -> tuple[torch.Tensor, AuxLists]:
    """MoD without selection (static mode, or capacity 1): every token through the block, the
    update mixed in with the router weight."""
    logit = router_logits(h, wrapper.router.weight[0], wrapper.router.bias[0], with_detached=False)[0]
    weight = torch.sigmoid(logit)
    h_out, aux = wrapper.mor(h, pos, None, ctx)
    if not ctx.generating:
        one = torch.ones((), device=h.device)
        wrapper.record_stats(one, weight, one)
    return gated_mix(h, weight, h_out), aux


def ones_like_rows(h: torch.Tensor) -> torch.Tensor:
    return torch.ones(h.shape[0], h.shape[1], device=h.device)


@register_routing
class DenseRouting(RoutingRule):
    """No routers: every token takes every recursion (MoR off, one recursion, or routing off)."""

    name = "dense"

    def mor_forward(self, block, h, pos, member, ctx, aux):
        for r in range(block.recursions):
            h, moe_loss = block.run_block(h, r, ctx, pos, None, member=member)
            add_aux(aux, "moe_balance", moe_loss)
        if ctx.generating or not block.records_depth:
            # depths feed only statistics, which neither a generation nor a dense block records;
            # a rule of its own that runs this one still reports depth R
            return h, None, None
        full = ones_like_rows(h) * block.recursions
        return h, full, full


@register_routing
class StaticRouting(RoutingRule):
    """Soft routing: every token everywhere, updates scaled by the router weights; dense compute,
    fixed shapes (CUDA-graph capturable)."""

    name = "static"

    def mod_forward(self, wrapper, h, pos, ctx):
        return soft_mod(wrapper, h, pos, ctx)

    def mor_forward(self, block, h, pos, member, ctx, aux):
        reach, expected = ones_like_rows(h), torch.zeros(h.shape[0], h.shape[1], device=h.device)
        for r in range(block.recursions):
            logit = block.logits(h, r, bce=False)[0]
            h, moe_loss = block.run_block(h, r, ctx, pos, block.alpha * torch.sigmoid(logit), member=member)
            add_aux(aux, "moe_balance", moe_loss)
            add_aux(aux, "router_z", masked_mean(logit.pow(2), member))
            reach = reach * torch.sigmoid(logit)  # not detached: the ponder penalty trains routers
            expected = expected + reach
        return h, ones_like_rows(h) * block.recursions, expected


@register_routing
class TokenChoiceRouting(RoutingRule):
    """MoR token choice: a softmax over depths 1..R decided at the block input, gate α·p(depth),
    Switch-style balance loss. Per-token counts are data-dependent, so it runs a selected-first
    permutation at full length (fixed shapes, no compute saved)."""

    name = "token_choice"

    def mor_forward(self, block, h, pos, member, ctx, aux):
        b, n, _ = h.shape
        logits = block.router(router_input(h)).float()  # [B, n, R]: depth 1..R
        probs = logits.softmax(dim=-1)
        choice = probs.argmax(dim=-1)  # [B, n]
        gate = block.alpha * probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        depth_tok = choice + 1
        all_pos = positions_or_arange(pos, b, n, h.device)
        for r in range(block.recursions):
            if r == 0:  # every token goes at least once
                h, moe_loss = block.run_block(h, r, ctx, pos, gate, member=member)
            else:
                selected = depth_tok > r if member is None else (depth_tok > r) & member
                h, moe_loss = block.run_block(
                    h, r, ctx, pos, gate, view=SubSequence.permuted(selected, all_pos)
                )
            add_aux(aux, "moe_balance", moe_loss)
        add_aux(aux, "router_z", masked_mean(torch.logsumexp(logits, dim=-1).pow(2), member))
        if block.training:
            onehot = F.one_hot(choice, block.recursions).float()  # [B, n, R]
            frac = torch.stack([masked_mean(onehot[..., j], member) for j in range(block.recursions)])
            p_mean = torch.stack([masked_mean(probs[..., j], member) for j in range(block.recursions)])
            add_aux(aux, "mor_balance", block.recursions * (frac.detach() * p_mean).sum())
        depths = torch.arange(1, block.recursions + 1, device=h.device, dtype=probs.dtype)
        return h, depth_tok.float(), (probs * depths).sum(-1)


# the token-selection rules live in their own modules; importing them registers them
from hydra_model import routing_causal, routing_expert_choice  # noqa: E402, F401
