"""The block hierarchy: CCGQABlock (attention + FFN) ← CCGQAMoRBlock (recursion routing) ←
CCGQAMoDBlockWrapper (depth routing).

Which tokens a MoD point or a MoR recursion takes is a routing rule (routing_rules.py: one class
per rule, registered by name; ``causal`` by default, see routing_causal.py): the blocks build the
rule's routers once and call it. A MoR block's ``mode`` names its rule (``dense`` without a
router); a MoD wrapper routes by ``HydraConfig.routing``, or ``static`` while ``static`` is set.
Routing statistics are written into non-persistent buffers (detached, no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import fused_add_rms_norm
from hydra_model.cache import ModelCache
from hydra_model.ccgqa import CCGQAAttention
from hydra_model.config import HydraConfig
from hydra_model.fused_decide import decision_buffers
from hydra_model.fused_routing import gated_residual, gated_scatter, router_logits
from hydra_model.gqa import GQAAttention
from hydra_model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, autocast_dtype_for
from hydra_model.moe import MoEFFN
from hydra_model.routing import masked_mean, masked_mean_last
from hydra_model.routing_rules import AuxLists, add_aux, routing_rule


@dataclass
class RunContext:
    """What every block application of one forward shares."""

    rope: RotaryEmbedding | None
    cache: ModelCache | None = None
    #: length of the whole sequence this forward runs (gather sizes of causal routing)
    seq_len: int = 0
    #: decoding may read a routing decision on the host to skip a block (one sync each); False
    #: while a decode step is captured as a CUDA graph: the block then runs, its update masked
    host_reads: bool = True
    #: set by a staged decode step's stage for an unrouted block (decode_graphs.py), which owns the
    #: stream buffer: the block writes the new stream into it (no new tensor and copy back)
    residual_in_place: bool = False
    #: (positions, cos, sin) last gathered: every unrouted block of a decode step reads the same
    #: positions tensor, so its tables are gathered once a step, not once a block
    _tables: tuple | None = field(default=None, repr=False)
    #: a staged decoder's flag vector [n] bool: each routed block's decision flag is one of its
    #: slots, so that one kernel a step tallies them all (decode_graphs.py)
    flag_pool: torch.Tensor | None = None
    _flags_taken: int = field(default=0, repr=False)
    #: per block index, its CCGQA module's conv weight and bias for this forward, folded for every
    #: block at once (:func:`~hydra_model.ccgqa_fold.fold_blocks`); None: each module folds its own
    convs: list | None = field(default=None, repr=False)

    @property
    def decoding(self) -> bool:
        return self.cache is not None and self.cache.decoding

    @property
    def generating(self) -> bool:
        """A forward with a cache (a prompt's prefill or a decode step): it records no MoD or MoR
        statistics and skips the causal rule's auxiliary losses, which only a forward without one
        (training, evaluation) reports; those statistics stay that forward's (MoE layers still
        record theirs). Such a forward takes no targets (model.py)."""
        return self.cache is not None

    @property
    def counts(self) -> dict | None:
        return None if self.cache is None else self.cache.counts

    def tables(self, n: int, pos: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.rope is None:
            return None, None
        if pos is None:
            return self.rope.tables(n)
        if self._tables is None or self._tables[0] is not pos:
            self._tables = (pos, *self.rope.tables(positions=pos))
        return self._tables[1], self._tables[2]

    def take_flag(self) -> torch.Tensor | None:
        """The next free slot of :attr:`flag_pool` (a 0-d view), or None when there is none."""
        if self.flag_pool is None or self._flags_taken >= self.flag_pool.numel():
            return None
        self._flags_taken += 1
        return self.flag_pool[self._flags_taken - 1]

    def forget_tables(self) -> None:
        """A context that outlives a decode step (decode_graphs.py) whose positions tensor then
        advances in place: the next step gathers its tables again."""
        self._tables = None


def _conv_arg(conv) -> dict:
    """The attention's ``conv`` keyword where there is one (GQA attention takes none)."""
    return {} if conv is None else {"conv": conv}


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

    def forward(
        self, h, cos, sin, *, slot=None, member=None, conv=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [B, n, E] → (update [B, n, E], MoE balance loss or None). ``conv``: the CCGQA
        module's folded conv weight and bias, where the forward folded every block's at once."""
        # under autocast the norms read and write the matmul dtype: the fp32 residual stream is
        # rounded once here instead of each norm's fp32 output being cast before its matmul
        # (half the bytes through both norms, forward and backward); statistics stay fp32
        x = h.to(autocast_dtype_for(h))
        a = self.attn(self.norm1(x), cos, sin, slot=slot, member=member, **_conv_arg(conv))
        x2 = self.norm2.forward_add(a, x)
        m, moe_loss = self._ffn(x2, member)
        return a + m, moe_loss

    def forward_residual(
        self, h, cos, sin, *, slot=None, member=None, into: torch.Tensor | None = None, conv=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new stream (h + a) + m rather than the update a + m, for a stream h already in the
        matmul dtype (a decode step): the fused norm's sum is the first residual add, so the block
        ends in one add where :meth:`forward` and its caller need two (the dense GPT's layer sums
        the same way). ``into``: the buffer written (h itself in a decode stage that owns it)."""
        a = self.attn(self.norm1(h), cos, sin, slot=slot, member=member, **_conv_arg(conv))
        x2, s = fused_add_rms_norm(a, h, self.norm2.weight, self.norm2.eps)  # norm2(h + a), h + a
        m, moe_loss = self._ffn(x2, member)
        if into is None:
            return s + m, moe_loss
        if torch.result_type(s, m) == into.dtype:
            return torch.add(s, m, out=into), moe_loss
        return into.copy_(s + m), moe_loss

    def _ffn(self, x: torch.Tensor, member) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(self.ffn, MoEFFN):
            return self.ffn(x, member)
        return self.ffn(x), None


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
        # the rule this block routes by (routing_rules.py); a switch to static routing and back
        # (hydra-train's static_routing toggle) returns to ``dynamic_mode``
        # the rule this block routes by (routing_rules.py). Its modules are built for the dynamic
        # rule even in static mode, so that hydra-train's static_routing toggle can switch a model
        # built static to dynamic routing and back (``mode`` is what runs, ``dynamic_mode`` the rule)
        if not cfg.mor_routed:
            self.dynamic_mode = "dense"
        else:
            self.dynamic_mode = cfg.routing if cfg.mor_routing == "expert_choice" else cfg.mor_routing
        static = cfg.static_routing_mode and self.dynamic_mode != "dense"
        self.mode = "static" if static else self.dynamic_mode
        self.block = CCGQABlock(cfg)
        # static and token selection: one logit per recursion; token choice: logits over depths 1..R
        self.router = None if self.dynamic_mode == "dense" else nn.Linear(cfg.dim, self.recursions)
        self.causal = nn.ModuleDict()  # the causal rule's thresholds, per recursion (empty otherwise)
        routing_rule(self.dynamic_mode).build_mor(self, cfg, parent_capacity)
        self.register_buffer("stat_depth", torch.zeros(2), persistent=False)  # [avg, expected]
        self.register_buffer("stat_depth_hist", torch.zeros(self.recursions + 1), persistent=False)

    @property
    def records_depth(self) -> bool:
        """Whether a training forward records this block's depth statistics (and routing_stats()
        reports them): not for a dense block, whose every token goes all R recursions."""
        return self.mode != "dense"

    def logits(self, h: torch.Tensor, r: int, bce: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Recursion r's router logit [B, n] on the normalised stream, and (``bce``) the same value
        for the membership BCE (gradient to the router only); see :func:`router_logits`."""
        return router_logits(h, self.router.weight[r], self.router.bias[r], with_detached=bce)

    def run_block(self, h, r, ctx, pos, gate, view=None, member=None):
        """Add gate·update of the shared block to h, on all rows (view None) or a routed view."""
        slot = ctx.cache.slot(self.block_index, r) if ctx.cache is not None else None
        conv = None if ctx.convs is None else ctx.convs[self.block_index]
        if view is None:
            cos, sin = ctx.tables(h.shape[1], pos)
            summed_as_decoding = ctx.decoding or not torch.is_grad_enabled()
            if gate is None and summed_as_decoding and autocast_dtype_for(h) == h.dtype:
                # (h + a) + m, as decoding sums: a forward without gradients (a prefill, an
                # evaluation) then adds as its decode steps do, in one launch fewer a block; a
                # stage that owns h gets it in place
                into = h if ctx.residual_in_place else None
                return self.block.forward_residual(
                    h, cos, sin, slot=slot, member=member, into=into, conv=conv
                )
            delta, moe_loss = self.block(h, cos, sin, slot=slot, member=member, conv=conv)
            if gate is None:
                return h + delta, moe_loss  # promotes to h's dtype in the same pass
            return gated_residual(h, gate, delta), moe_loss
        hs = view.gather(h)
        cos, sin = ctx.tables(hs.shape[1], view.pos)
        delta, moe_loss = self.block(hs, cos, sin, slot=slot, member=view.member, conv=conv)
        if view.member is None:  # top-k view: every gathered row is real
            return gated_scatter(h, view.flat, view.idx, gate, delta), moe_loss
        return view.scatter_add(h, view.gather_values(gate).unsqueeze(-1) * delta), moe_loss

    def forward(self, h, pos, member, ctx: RunContext) -> tuple[torch.Tensor, AuxLists]:
        """h [B, n, E] with positions pos [B, n] (None = 0..n−1) and real rows ``member`` (None =
        all; otherwise a prefix mask) → (new h, auxiliary loss terms)."""
        aux: AuxLists = {}
        big_r = self.recursions
        h, depth, expected = routing_rule(self.mode).mor_forward(self, h, pos, member, ctx, aux)
        if ctx.generating or depth is None:
            # statistics and the ponder loss: a dozen kernels a block, read by no one. A rule
            # returns no depths where there is nothing to record (records_depth: the dense rule's
            # statistics were ~20 traced ops a block, a tenth of the 100M preset's compiled
            # training forward)
            return h, aux
        if self.ponder:
            add_aux(aux, "ponder", masked_mean(expected, member) / big_r)
        with torch.no_grad():
            hist = F.one_hot(depth.detach().round().long().clamp(0, big_r), big_r + 1).float()
            both = torch.stack([depth.detach(), expected.detach()], -1)  # [B, n, 2]
            self.stat_depth.copy_(masked_mean_last(both, member))
            self.stat_depth_hist.copy_(masked_mean_last(hist, member))
        return h, aux


class CCGQAMoDBlockWrapper(nn.Module):
    """Mixture-of-Depths around a CCGQAMoRBlock: only the tokens its routing rule takes (at most
    ⌈capacity·S⌉) go through; the others pass on the residual."""

    def __init__(self, cfg: HydraConfig, block_index: int) -> None:
        super().__init__()
        self.block_index = block_index
        self.routed = cfg.mod_routed(block_index)
        self.capacity = cfg.mod_capacity
        #: the token-selection rule (HydraConfig.routing); ``static`` overrides it while set
        self.rule = cfg.routing
        self.static = cfg.static_routing_mode
        #: the causal rule's threshold and budget (None for other rules and capacity 1); built in
        #: static mode too, for a switch to dynamic routing (see CCGQAMoRBlock)
        self.causal = None
        if self.routed:
            routing_rule(self.rule).build_mod(self, cfg)
        parent = self.capacity if self.causal is not None else 1.0
        self.mor = CCGQAMoRBlock(cfg, block_index, parent)
        # registered after the MoR block: parameters are created and initialised in registration
        # order, so a seed gives the weights it gave before the rules moved out (the race's runs)
        self.router = nn.Linear(cfg.dim, 1) if self.routed else None
        # [selected_frac, mean prob, passed_frac (router cleared its threshold, before any budget)]
        self.register_buffer("stat_mod", torch.zeros(3), persistent=False)

    def forward(
        self, h: torch.Tensor, pos: torch.Tensor | None, ctx: RunContext
    ) -> tuple[torch.Tensor, AuxLists]:
        """h [B, S, E], positions (None = 0..S−1) → (new h, auxiliary loss terms)."""
        if not self.routed:
            return self.mor(h, pos, None, ctx)
        return routing_rule("static" if self.static else self.rule).mod_forward(self, h, pos, ctx)

    def decode_stages(self, h: torch.Tensor, pos: torch.Tensor, ctx: RunContext) -> list:
        """This block's part of a staged decode step on the stream buffer h [B, 1, E] (updated in
        place; decode_graphs.py): with a rule that splits its decode step, the decision (a flag:
        any token taken) and the block gated on it; otherwise the whole forward, one stage."""
        from hydra_model.decode_graphs import DecodeStage

        rule = routing_rule("static" if self.static else self.rule)
        if not (self.routed and rule.staged_decode and self.causal is not None):
            # this stage owns h: the update of a block with no routing anywhere (no MoD router,
            # dense recursions) may go into it in place. Not so where a rule reads its input again
            # after the block (a gate mixing in and out, a gathered copy, a gated stage)
            in_place = not self.routed and self.mor.mode == "dense"

            def whole() -> None:
                ctx.residual_in_place = in_place
                try:
                    out = self(h, pos, ctx)[0]
                finally:
                    ctx.residual_in_place = False
                if out is not h:  # not added in place (RunContext.residual_in_place)
                    h.copy_(out)

            return [DecodeStage(whole)]
        taken, weight, flag = decision_buffers(h, ctx.take_flag())  # [B, 1], [B, 1], []: decide writes

        def decide() -> None:
            rule.decode_decide_into(self, h, pos, ctx, taken, weight, flag)

        def apply() -> None:
            rule.decode_apply_into(self, h, pos, ctx, taken, weight)

        return [DecodeStage(decide, flag=flag), DecodeStage(apply, gated=True)]

    @torch.no_grad()
    def record_stats(self, taken_frac: torch.Tensor, weight: torch.Tensor, passed_frac: torch.Tensor) -> None:
        """The last forward's share of tokens taken, mean router weight and share that cleared the
        threshold (no host sync)."""
        self.stat_mod.copy_(torch.stack([taken_frac, weight.detach().mean(), passed_frac]))
