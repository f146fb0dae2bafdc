"""The ``causal`` routing rule (the default): a token passes a MoD point or a MoR recursion when its
router logit clears the point's tracked threshold and the point's causal budget is not spent
(causal_routing.py); the same rule in training, evaluation and decoding."""

from __future__ import annotations

import torch
from torch import nn

from hydra_kernels.ops.causal_select import causal_select
from hydra_kernels.ops.gated_update import gated_update_
from hydra_model.cache import kept_or_new
from hydra_model.causal_routing import CAPACITY_BITS, CAPACITY_ONE, CausalRouter, take_first_k
from hydra_model.fused_decide import decide_into, decision_buffers, fused_decide_applies
from hydra_model.fused_routing import router_logits
from hydra_model.routing import SubSequence, flat_index, masked_mean, positions_or_arange
from hydra_model.routing_rules import RoutingRule, add_aux, merge_aux, register_routing, soft_mod


def select_tokens(
    router: CausalRouter, logit: torch.Tensor, pos: torch.Tensor | None, candidates, ctx
) -> tuple[torch.Tensor, SubSequence]:
    """A whole sequence's decision at one routing point: (taken [B, n] bool, the view of its
    first ⌈c·S⌉ tokens, taken first). A forward without gradients (evaluation, a prompt's
    prefill) makes it in one kernel (hydra_kernels' ``causal_select``: at batch 1 a prefill is
    bound by its launches); training op by op, recording its threshold statistics. The same
    integers either way (tests/hydra_model/test_routing_causal_select.py)."""
    b, n = logit.shape
    k = router.rows(n, ctx.seq_len or n)
    counts = ctx.counts
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # the cache's counter, written in place where it has one (put_count's rule)
        held = None if counts is None else kept_or_new(counts.get(router.key), (b,), torch.long, logit.device)
        taken, idx, member, pos_k, flat, count = causal_select(
            logit, router.threshold.tau, candidates, pos, router.cap_q, CAPACITY_BITS, CAPACITY_ONE, k,
            count_out=held,
        )  # fmt: skip
        if counts is not None:
            counts[router.key] = count
        return taken, SubSequence(idx, pos_k, member, flat)
    all_pos = positions_or_arange(pos, b, n, logit.device)
    taken = router.decide(logit, all_pos, candidates, counts, False)
    idx, member = take_first_k(taken, k)
    return taken, SubSequence(idx, all_pos.gather(1, idx), member, flat_index(idx, n))


@register_routing
class CausalRouting(RoutingRule):
    name = "causal"
    selects_tokens = True
    staged_decode = True

    def build_mod(self, wrapper, cfg) -> None:
        if wrapper.capacity < 1.0:
            key = (wrapper.block_index, -1)
            wrapper.causal = CausalRouter(
                wrapper.capacity, wrapper.capacity, cfg.router_threshold_momentum, key
            )

    def build_mor(self, block, cfg, parent_capacity: float) -> None:
        # a decision per recursion of capacity < 1, on the candidates of the one before
        block.causal = nn.ModuleDict()
        caps = block.capacities
        for r in range(1, block.recursions):
            if caps[r] < 1.0:
                block.causal[str(r)] = CausalRouter(
                    parent_capacity * caps[r],
                    caps[r] / caps[r - 1],
                    cfg.router_threshold_momentum,
                    (block.block_index, r),
                )

    def mod_forward(self, wrapper, h, pos, ctx):
        """The taken tokens, gathered into a fixed ⌈capacity · S⌉ rows (unused rows masked), go
        through the MoR block; the update is σ(logit)·(out − in). Decoding one token skips the
        block when it is not taken."""
        if wrapper.causal is None:  # capacity 1: nothing to decide
            return soft_mod(wrapper, h, pos, ctx)
        b = h.shape[0]
        if ctx.decoding:
            taken, weight = self.decode_decide(wrapper, h, pos, ctx)
            if b == 1 and ctx.host_reads and not bool(taken):  # one host sync: the block is skipped
                return h, {}
            return self.decode_apply(wrapper, h, pos, ctx, taken, weight)
        logit = router_logits(h, wrapper.router.weight[0], wrapper.router.bias[0], with_detached=False)[0]
        weight = torch.sigmoid(logit)
        aux = {} if ctx.generating else {"router_z": [logit.pow(2).mean()]}
        taken, view = select_tokens(wrapper.causal, logit, pos, None, ctx)
        hs = view.gather(h)  # [B, ⌈c·S⌉, E]
        hs_out, inner = wrapper.mor(hs, view.pos, view.member, ctx)
        merge_aux(aux, inner)
        if _fused_update(h, hs_out, weight):  # no gradients: one kernel on a copy of the stream
            b, n, e = h.shape
            new_h = h.clone(memory_format=torch.contiguous_format)
            member = None if view.member is None else view.member.reshape(-1)
            gated_update_(new_h.view(b * n, e), hs_out.reshape(-1, e), weight.reshape(-1), member, view.flat)
        else:
            new_h = view.scatter_add(h, view.gather_values(weight).unsqueeze(-1) * (hs_out - hs))
        if not ctx.generating:
            self._record(wrapper, logit, taken, weight)
        return new_h, aux

    @staticmethod
    def _record(wrapper, logit, taken, weight) -> None:
        with torch.no_grad():
            passed = wrapper.causal.threshold.passes(logit.detach()).float().mean()
        wrapper.record_stats(taken.float().mean(), weight, passed)

    # a decode step in two halves, so that a graphed decoder (decode_graphs.py) can read the
    # decision on the host between them and skip the second
    def decode_decide(self, wrapper, h, pos, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoded token h [B, 1, E]: (taken [B, 1] bool, router weight σ(logit) [B, 1]); the
        point's counter in the cache advances where taken. The routing statistics stay those of
        the prompt's forward (a decode step's would be one token's). One kernel where
        :func:`~hydra_model.fused_decide.fused_decide_applies` (a GPU's decode step), else op by op."""
        if self._fused(wrapper, h, pos):
            taken, weight, flag = decision_buffers(h)
            decide_into(wrapper.causal, wrapper.router, h, pos, ctx.counts, taken, weight, flag)
            return taken, weight
        logit = router_logits(h, wrapper.router.weight[0], wrapper.router.bias[0], with_detached=False)[0]
        weight = torch.sigmoid(logit)
        all_pos = positions_or_arange(pos, h.shape[0], 1, h.device)
        taken = wrapper.causal.decide(logit, all_pos, None, ctx.counts, True)
        return taken, weight

    def decode_decide_into(self, wrapper, h, pos, ctx, taken, weight, flag) -> None:
        """Fused, the kernel writes the decision into the buffers itself; op by op, it is copied in
        (three copies and an ``any``: RoutingRule's)."""
        if self._fused(wrapper, h, pos):
            decide_into(wrapper.causal, wrapper.router, h, pos, ctx.counts, taken, weight, flag)
            return
        super().decode_decide_into(wrapper, h, pos, ctx, taken, weight, flag)

    @staticmethod
    def _fused(wrapper, h, pos) -> bool:
        return fused_decide_applies(h, pos, (wrapper.router.weight, wrapper.router.bias))

    def decode_apply_into(self, wrapper, h, pos, ctx, taken, weight) -> None:
        """:meth:`decode_apply` written into h in place: one kernel for the update where
        :func:`_fused_update` applies (a graphed step captures one launch instead of seven)."""
        h_out, _ = wrapper.mor(h, pos, taken, ctx)
        if _fused_update(h, h_out, weight):
            b, _, e = h.shape
            gated_update_(h.view(b, e), h_out.reshape(b, e), weight.view(b), taken.view(b))
        else:
            h.copy_(self._gated(h, h_out, taken, weight))

    def decode_apply(self, wrapper, h, pos, ctx, taken, weight):
        """The MoR block on the decoded token, its update σ(logit)·(out − in) kept where taken (a
        token not taken leaves h and every cache slot of the block unchanged)."""
        h_out, aux = wrapper.mor(h, pos, taken, ctx)
        return self._gated(h, h_out, taken, weight), aux

    @staticmethod
    def _gated(h, h_out, taken, weight) -> torch.Tensor:
        # the product in the weight's precision (fp32) as the full forward's, and a row not taken
        # masked by where (not multiplied by 0: its output is not read, whatever it holds)
        update = (weight.unsqueeze(-1) * (h_out - h)).to(h.dtype)
        return h + torch.where(taken.unsqueeze(-1), update, torch.zeros_like(update))

    def mor_forward(self, block, h, pos, member, ctx, aux):
        """The candidates of recursion r are the tokens recursion r−1 took; its rows are gathered
        into a fixed ⌈parent · c_r · S⌉. Decoding one token runs only the recursions it is taken
        into."""
        b, n, _ = h.shape
        active = member  # None: every row is a candidate
        depth = torch.zeros(b, n, device=h.device)
        expected = torch.zeros(b, n, device=h.device)
        reach = torch.ones(b, n, device=h.device)
        for r in range(block.recursions):
            logit = block.logits(h, r, bce=False)[0]
            prob = torch.sigmoid(logit)
            gate = block.alpha * prob
            if not ctx.generating:
                add_aux(aux, "router_z", masked_mean(logit.pow(2), active))
            router = block.causal[str(r)] if str(r) in block.causal else None  # noqa: SIM401
            if router is None:  # capacity 1: every candidate goes
                h, moe_loss = block.run_block(h, r, ctx, pos, gate, member=active)
                taken = active
            else:
                reach = reach * prob
                if ctx.decoding:
                    pos_all = positions_or_arange(pos, b, n, h.device)
                    taken = router.decide(logit, pos_all, active, ctx.counts, True)
                    if b == 1 and ctx.host_reads and not bool(taken):  # one host sync: skip the rest
                        break
                    stepped, moe_loss = block.run_block(h, r, ctx, pos, gate, member=taken)
                    h = torch.where(taken.unsqueeze(-1), stepped, h)
                else:
                    taken, view = select_tokens(router, logit, pos, active, ctx)
                    h, moe_loss = block.run_block(h, r, ctx, pos, gate, view=view)
            add_aux(aux, "moe_balance", moe_loss)
            depth = depth + (1.0 if taken is None else taken.float())
            expected = expected + reach
            active = taken
        return h, depth, expected


def _fused_update(h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a routed block's gated update may run as hydra_kernels' ``gated_update_`` kernel:
    no gradients, not inside torch.compile, out in the stream's dtype, fp32 router weights (the
    op-by-op form's arithmetic, which the kernel reproduces bit for bit)."""
    return (
        not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and out.dtype == h.dtype
        and weight.dtype == torch.float32
    )
