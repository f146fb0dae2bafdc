"""The block hierarchy: CCGQABlock (attention + FFN) ← CCGQAMoRBlock (recursion routing) ←
CCGQAMoDBlockWrapper (depth routing). Routing modes:

==============  ==================================  =========================================
mode            training (model.train())            eval / decoding (model.eval())
==============  ==================================  =========================================
causal          threshold + causal budget,          the same rule, the same gather (a decode
(the default)   gathered into ⌈c·S⌉ rows            step skips what its token is routed out of)
expert_choice   top-k per sequence (sees the        causal threshold (σ(logit) > ½) over a
(ablation)      future), gathered in time order     selected-first permutation of all rows
static          soft: every token, update × weight  same as training (already causal)
token choice    MoR depth chosen per token up front same as training (already causal)
dense           no routers, every token everywhere  same
==============  ==================================  =========================================

Updates are scaled by the router weight (MoD: σ(logit); MoR: α·σ(logit)) so routers learn from
the LM loss. Causal routing (causal_routing.py) needs nothing more; expert choice adds a BCE
auxiliary loss that teaches the routers to predict top-k membership from the token alone, which
its evaluation threshold relies on. Routing statistics are written into non-persistent buffers
(detached, no host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hydra_model.cache import ModelCache
from hydra_model.causal_routing import CausalRouter, take_first_k
from hydra_model.ccgqa import CCGQAAttention
from hydra_model.config import HydraConfig
from hydra_model.fused_routing import (
    expert_choice_select,
    gated_mix,
    gated_residual,
    gated_scatter,
    router_logits,
)
from hydra_model.gqa import GQAAttention
from hydra_model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, autocast_dtype_for
from hydra_model.moe import MoEFFN
from hydra_model.routing import (
    SubSequence,
    flat_index,
    masked_mean,
    masked_mean_last,
    membership_bce,
    positions_or_arange,
)

AuxLists = dict[str, list[torch.Tensor]]


@dataclass
class RunContext:
    """What every block application of one forward shares."""

    rope: RotaryEmbedding | None
    cache: ModelCache | None = None
    #: length of the whole sequence this forward runs (gather sizes of causal routing)
    seq_len: int = 0

    @property
    def decoding(self) -> bool:
        return self.cache is not None and self.cache.decoding

    @property
    def counts(self) -> dict | None:
        return None if self.cache is None else self.cache.counts

    def tables(self, n: int, pos: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.rope is None:
            return None, None
        return self.rope.tables(n) if pos is None else self.rope.tables(positions=pos)


def router_input(h: torch.Tensor) -> torch.Tensor:
    """Routers score the RMS-normalised residual stream: its scale grows with depth and starts at
    the embedding's (≈ 0.02), which would leave every initial logit near 0 and every σ near ½."""
    return F.rms_norm(h, (h.shape[-1],), eps=1e-6)


def _add(aux: AuxLists, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        aux.setdefault(name, []).append(value)


def merge_aux(into: AuxLists, other: AuxLists) -> None:
    for name, values in other.items():
        into.setdefault(name, []).extend(values)


class CCGQABlock(nn.Module):
    """Pre-norm block: h → (attn(norm1 h) + ffn(norm2(h + attn))) as an update, not a new h."""

    def __init__(self, cfg: HydraConfig) -> None:
        super().__init__()
        e = cfg.dim
        self.norm1 = RMSNorm(e, cfg.norm_eps)
        self.norm2 = RMSNorm(e, cfg.norm_eps)
        if cfg.routing_off:
            n_q = e // cfg.head_dim
            self.attn: nn.Module = GQAAttention(
                e, n_q, n_q * cfg.n_kv_heads // cfg.n_heads, cfg.head_dim, cfg.rotary_dim
            )
        else:
            self.attn = CCGQAAttention(
                e,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.rotary_dim,
                cfg.conv_kernel_seq,
                cfg.conv_kernel_ch,
            )
        if cfg.moe_enabled:
            self.ffn: nn.Module = MoEFFN(
                e,
                cfg.expert_hidden,
                cfg.moe_num_experts,
                cfg.moe_top_k,
                cfg.moe_balancing,
                cfg.moe_bias_update_rate,
            )
        else:
            self.ffn = SwiGLUMLP(e, cfg.mlp_hidden)

    def forward(self, h, cos, sin, *, slot=None, member=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [B, n, E] → (update [B, n, E], MoE balance loss or None)."""
        # under autocast the norms read and write the matmul dtype: the fp32 residual stream is
        # rounded once here instead of each norm's fp32 output being cast before its matmul
        # (half the bytes through both norms, forward and backward); statistics stay fp32
        x = h.to(autocast_dtype_for(h))
        a = self.attn(self.norm1(x), cos, sin, slot=slot, member=member)
        x2 = self.norm2.forward_add(a, x)
        if isinstance(self.ffn, MoEFFN):
            m, moe_loss = self.ffn(x2, member)
        else:
            m, moe_loss = self.ffn(x2), None
        return a + m, moe_loss


class CCGQAMoRBlock(nn.Module):
    """One shared CCGQABlock applied up to R times; a router decides per token how deep it goes."""

    def __init__(self, cfg: HydraConfig, block_index: int, parent_capacity: float = 1.0) -> None:
        """``parent_capacity``: the share of the sequence the enclosing MoD lets through (1.0
        when this block sees every token); causal budgets are relative to the whole sequence."""
        super().__init__()
        self.block_index = block_index
        self.recursions = cfg.recursions_per_block
        self.capacities = cfg.mor_capacity_schedule
        self.alpha = cfg.mor_gate_alpha
        self.ponder = cfg.ponder_weight > 0
        self.mode = (
            "dense"
            if not cfg.mor_routed
            else "static"
            if cfg.static_routing_mode
            else cfg.mor_routing
        )
        if self.mode == "expert_choice" and cfg.routing == "causal":
            self.mode = "causal"
        #: the mode a switch to static routing and back returns to
        self.dynamic_mode = self.mode
        self.block = CCGQABlock(cfg)
        # expert choice / static: one logit per recursion; token choice: logits over depths 1..R
        self.router = None if self.mode == "dense" else nn.Linear(cfg.dim, self.recursions)
        # causal: a decision per recursion of capacity < 1, on the candidates of the one before
        self.causal = nn.ModuleDict()
        if self.mode == "causal":
            caps = self.capacities
            for r in range(1, self.recursions):
                if caps[r] < 1.0:
                    self.causal[str(r)] = CausalRouter(
                        parent_capacity * caps[r],
                        caps[r] / caps[r - 1],
                        cfg.router_threshold_momentum,
                        (block_index, r),
                    )
        self.register_buffer("stat_depth", torch.zeros(2), persistent=False)  # [avg, expected]
        self.register_buffer("stat_depth_hist", torch.zeros(self.recursions + 1), persistent=False)

    def _logits(self, h: torch.Tensor, r: int, bce: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Recursion r's router logit [B, n] on the normalised stream, and (``bce``) the same value
        for the membership BCE (gradient to the router only); see :func:`router_logits`."""
        return router_logits(h, self.router.weight[r], self.router.bias[r], with_detached=bce)

    def _run_block(self, h, r, ctx, pos, gate, view=None, member=None):
        """Add gate·update of the shared block to h, on all rows (view None) or a routed view."""
        slot = ctx.cache.slot(self.block_index, r) if ctx.cache is not None else None
        if view is None:
            cos, sin = ctx.tables(h.shape[1], pos)
            delta, moe_loss = self.block(h, cos, sin, slot=slot, member=member)
            if gate is None:
                return h + delta, moe_loss  # promotes to h's dtype in the same pass
            return gated_residual(h, gate, delta), moe_loss
        hs = view.gather(h)
        cos, sin = ctx.tables(hs.shape[1], view.pos)
        delta, moe_loss = self.block(hs, cos, sin, slot=slot, member=view.member)
        if view.member is None:  # top-k view: every gathered row is real
            return gated_scatter(h, view.flat, view.idx, gate, delta), moe_loss
        return view.scatter_add(h, view.gather_values(gate).unsqueeze(-1) * delta), moe_loss

    def forward(self, h, pos, member, ctx: RunContext) -> tuple[torch.Tensor, AuxLists]:
        """h [B, n, E] with positions pos [B, n] (None = 0..n−1) and real rows ``member`` (None =
        all; otherwise a prefix mask) → (new h, auxiliary loss terms)."""
        aux: AuxLists = {}
        b, n, _ = h.shape
        big_r = self.recursions
        ones = torch.ones(b, n, device=h.device)
        if self.mode == "dense":
            for r in range(big_r):
                h, moe_loss = self._run_block(h, r, ctx, pos, None, member=member)
                _add(aux, "moe_balance", moe_loss)
            depth, expected = ones * big_r, ones * big_r
        elif self.mode == "static":
            reach, expected = ones, torch.zeros_like(ones)
            for r in range(big_r):
                logit = self._logits(h, r, bce=False)[0]
                h, moe_loss = self._run_block(
                    h, r, ctx, pos, self.alpha * torch.sigmoid(logit), member=member
                )
                _add(aux, "moe_balance", moe_loss)
                _add(aux, "router_z", masked_mean(logit.pow(2), member))
                reach = reach * torch.sigmoid(logit)  # not detached: the ponder penalty trains routers
                expected = expected + reach
            depth = ones * big_r
        elif self.mode == "token_choice":
            h, depth, expected = self._token_choice(h, pos, member, ctx, aux)
        elif self.mode == "causal":
            h, depth, expected = self._causal(h, pos, member, ctx, aux)
        else:
            h, depth, expected = self._expert_choice(h, pos, member, ctx, aux)
        if self.ponder and self.mode != "dense":
            _add(aux, "ponder", masked_mean(expected, member) / big_r)
        with torch.no_grad():
            hist = F.one_hot(depth.detach().round().long().clamp(0, big_r), big_r + 1).float()
            both = torch.stack([depth.detach(), expected.detach()], -1)  # [B, n, 2]
            self.stat_depth.copy_(masked_mean_last(both, member))
            self.stat_depth_hist.copy_(masked_mean_last(hist, member))
        return h, aux

    def _expert_choice(self, h, pos, member, ctx, aux):
        b, n, _ = h.shape
        active = member  # None: every row is a candidate
        depth = torch.zeros(b, n, device=h.device)
        expected = torch.zeros(b, n, device=h.device)
        reach = torch.ones(b, n, device=h.device)  # P(token reaches recursion r), for expected depth
        all_pos = None
        for r, cap in enumerate(self.capacities):
            routed_training = self.training and cap < 1.0
            logit, bce_logit = self._logits(h, r, bce=routed_training)
            if routed_training:
                # top-k among the active tokens, gates, aux terms and running statistics in one
                # fused call; the router learns membership from the token alone (bce_logit)
                all_pos = positions_or_arange(pos, b, n, h.device) if all_pos is None else all_pos
                k = math.ceil(cap * n)
                picked = expert_choice_select(
                    logit, bce_logit, active, all_pos, reach, depth, expected, k, self.alpha
                )
                gate, idx, flat, sel_pos, selected, z_loss, bce, reach, depth, expected = picked
                _add(aux, "router_z", z_loss)
                _add(aux, "mor_router", bce)
                view = SubSequence(idx, sel_pos, None, flat)
                h, moe_loss = self._run_block(h, r, ctx, pos, gate, view=view)
                _add(aux, "moe_balance", moe_loss)
                active = selected
                continue
            prob = torch.sigmoid(logit)
            gate = self.alpha * prob
            _add(aux, "router_z", masked_mean(logit.pow(2), active))
            if cap >= 1.0:
                h, moe_loss = self._run_block(h, r, ctx, pos, gate, member=active)
                selected = active
            else:
                # eval: causal threshold routing over the selected-first permutation
                all_pos = positions_or_arange(pos, b, n, h.device) if all_pos is None else all_pos
                reach = reach * prob
                selected = logit > 0 if active is None else (logit > 0) & active
                view = SubSequence.permuted(selected, all_pos)
                h, moe_loss = self._run_block(h, r, ctx, pos, gate, view=view)
            _add(aux, "moe_balance", moe_loss)
            depth = depth + (1.0 if selected is None else selected.float())
            expected = expected + reach
            active = selected
        return h, depth, expected

    def _causal(self, h, pos, member, ctx, aux):
        """Causal capacity routing per recursion (causal_routing.py): the candidates of
        recursion r are the tokens recursion r−1 took; its rows are gathered into a fixed
        ⌈parent · c_r · S⌉. Decoding one token runs only the recursions it is taken into."""
        b, n, _ = h.shape
        active = member  # None: every row is a candidate
        all_pos = positions_or_arange(pos, b, n, h.device)
        depth = torch.zeros(b, n, device=h.device)
        expected = torch.zeros(b, n, device=h.device)
        reach = torch.ones(b, n, device=h.device)
        for r in range(self.recursions):
            logit = self._logits(h, r, bce=False)[0]
            prob = torch.sigmoid(logit)
            gate = self.alpha * prob
            _add(aux, "router_z", masked_mean(logit.pow(2), active))
            router = self.causal[str(r)] if str(r) in self.causal else None  # noqa: SIM401
            if router is None:  # capacity 1: every candidate goes
                h, moe_loss = self._run_block(h, r, ctx, pos, gate, member=active)
                taken = active
            else:
                reach = reach * prob
                taken = router.decide(logit, all_pos, active, ctx.counts, ctx.decoding)
                if ctx.decoding:
                    if b == 1 and not bool(taken):  # one host sync a step: skip the rest
                        break
                    stepped, moe_loss = self._run_block(h, r, ctx, pos, gate, member=taken)
                    h = torch.where(taken.unsqueeze(-1), stepped, h)
                else:
                    idx, rows = take_first_k(taken, router.rows(n, ctx.seq_len or n))
                    view = SubSequence(idx, all_pos.gather(1, idx), rows, flat_index(idx, n))
                    h, moe_loss = self._run_block(h, r, ctx, pos, gate, view=view)
            _add(aux, "moe_balance", moe_loss)
            depth = depth + (1.0 if taken is None else taken.float())
            expected = expected + reach
            active = taken
        return h, depth, expected

    def _token_choice(self, h, pos, member, ctx, aux):
        b, n, _ = h.shape
        logits = self.router(router_input(h)).float()  # [B, n, R]: depth 1..R
        probs = logits.softmax(dim=-1)
        choice = probs.argmax(dim=-1)  # [B, n]
        gate = self.alpha * probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        depth_tok = choice + 1
        all_pos = positions_or_arange(pos, b, n, h.device)
        for r in range(self.recursions):
            if r == 0:  # every token goes at least once
                h, moe_loss = self._run_block(h, r, ctx, pos, gate, member=member)
            else:
                selected = depth_tok > r if member is None else (depth_tok > r) & member
                h, moe_loss = self._run_block(
                    h, r, ctx, pos, gate, view=SubSequence.permuted(selected, all_pos)
                )
            _add(aux, "moe_balance", moe_loss)
        _add(aux, "router_z", masked_mean(torch.logsumexp(logits, dim=-1).pow(2), member))
        if self.training:
            onehot = F.one_hot(choice, self.recursions).float()  # [B, n, R]
            frac = torch.stack([masked_mean(onehot[..., j], member) for j in range(self.recursions)])
            p_mean = torch.stack([masked_mean(probs[..., j], member) for j in range(self.recursions)])
            _add(aux, "mor_balance", self.recursions * (frac.detach() * p_mean).sum())
        depths = torch.arange(1, self.recursions + 1, device=h.device, dtype=probs.dtype)
        return h, depth_tok.float(), (probs * depths).sum(-1)


class CCGQAMoDBlockWrapper(nn.Module):
    """Mixture-of-Depths around a CCGQAMoRBlock: only the top ⌈capacity·S⌉ tokens go through."""

    def __init__(self, cfg: HydraConfig, block_index: int) -> None:
        super().__init__()
        self.block_index = block_index
        self.routed = cfg.mod_routed(block_index)
        self.capacity = cfg.mod_capacity
        self.static = cfg.static_routing_mode
        self.causal = (
            CausalRouter(self.capacity, self.capacity, cfg.router_threshold_momentum, (block_index, -1))
            if self.routed and cfg.routing == "causal" and not self.static and self.capacity < 1.0
            else None
        )
        parent = self.capacity if self.causal is not None else 1.0
        self.mor = CCGQAMoRBlock(cfg, block_index, parent)
        self.router = nn.Linear(cfg.dim, 1) if self.routed else None
        # [selected_frac, mean prob, passed_frac (router cleared its threshold, before any budget)]
        self.register_buffer("stat_mod", torch.zeros(3), persistent=False)

    def forward(
        self, h: torch.Tensor, pos: torch.Tensor | None, ctx: RunContext
    ) -> tuple[torch.Tensor, AuxLists]:
        """h [B, S, E], positions (None = 0..S−1) → (new h, auxiliary loss terms)."""
        if not self.routed:
            return self.mor(h, pos, None, ctx)
        if self.causal is not None and not self.static:
            return self._causal(h, pos, ctx)
        b, s, _ = h.shape
        bce = self.training and not (self.static or self.capacity >= 1.0)
        logit, bce_logit = router_logits(h, self.router.weight[0], self.router.bias[0], with_detached=bce)
        weight = torch.sigmoid(logit)
        aux: AuxLists = {}
        if self.static or self.capacity >= 1.0:
            h_out, aux = self.mor(h, pos, None, ctx)
            new_h = gated_mix(h, weight, h_out)
            selected_frac = torch.ones((), device=h.device)
        else:
            all_pos = positions_or_arange(pos, b, s, h.device)
            if self.training:
                view = SubSequence.top_k(logit.detach(), math.ceil(self.capacity * s), all_pos)
                selected = torch.zeros(b, s, dtype=torch.bool, device=h.device).scatter(1, view.idx, True)
                _add(aux, "mod_router", membership_bce(bce_logit, selected, None))
            else:
                selected = logit > 0  # σ(logit) > ½, decided by the token alone: causal
                view = SubSequence.permuted(selected, all_pos)
            hs = view.gather(h)
            hs_out, inner = self.mor(hs, view.pos, view.member, ctx)
            merge_aux(aux, inner)
            if view.member is None:
                new_h = gated_scatter(h, view.flat, view.idx, weight, hs_out, hs)
            else:
                new_h = view.scatter_add(h, view.gather_values(weight).unsqueeze(-1) * (hs_out - hs))
            selected_frac = selected.float().mean()
        with torch.no_grad():
            self.stat_mod.copy_(torch.stack([selected_frac, weight.detach().mean(), selected_frac]))
        return new_h, aux

    def _causal(
        self, h: torch.Tensor, pos: torch.Tensor | None, ctx: RunContext
    ) -> tuple[torch.Tensor, AuxLists]:
        """Causal capacity routing (causal_routing.py): the taken tokens, gathered into a fixed
        ⌈capacity · S⌉ rows (unused rows masked), go through the MoR block; the update is
        σ(logit)·(out − in). Decoding one token skips the block when it is not taken."""
        b, s, _ = h.shape
        logit = router_logits(h, self.router.weight[0], self.router.bias[0], with_detached=False)[0]
        weight = torch.sigmoid(logit)
        aux: AuxLists = {"router_z": [logit.pow(2).mean()]}
        all_pos = positions_or_arange(pos, b, s, h.device)
        taken = self.causal.decide(logit, all_pos, None, ctx.counts, ctx.decoding)
        if ctx.decoding:
            if b == 1 and not bool(taken):  # one host sync a step: the block is skipped
                new_h = h
            else:
                h_out, inner = self.mor(h, pos, taken, ctx)
                merge_aux(aux, inner)
                update = (weight.unsqueeze(-1) * (h_out - h)).to(h.dtype)
                new_h = h + torch.where(taken.unsqueeze(-1), update, torch.zeros_like(update))
        else:
            idx, rows = take_first_k(taken, self.causal.rows(s, ctx.seq_len or s))
            view = SubSequence(idx, all_pos.gather(1, idx), rows, flat_index(idx, s))
            hs = view.gather(h)
            hs_out, inner = self.mor(hs, view.pos, view.member, ctx)
            merge_aux(aux, inner)
            new_h = view.scatter_add(h, view.gather_values(weight).unsqueeze(-1) * (hs_out - hs))
        with torch.no_grad():
            passed = self.causal.threshold.passes(logit.detach()).float().mean()
            self.stat_mod.copy_(torch.stack([taken.float().mean(), weight.detach().mean(), passed]))
        return new_h, aux
