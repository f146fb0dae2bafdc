"""The ``expert_choice`` routing rule (an ablation): training takes the top-k of each sequence, as
the MoD and MoR papers do (it sees the future: a token's routing depends on later tokens' scores),
with BCE side losses teaching the routers to predict membership from the token alone; evaluation
routes by that prediction, σ(logit) > ½, over a selected-first permutation of every row."""

from __future__ import annotations

import math

import torch

from hydra_model.fused_routing import expert_choice_select, gated_scatter, router_logits
from hydra_model.routing import SubSequence, masked_mean, membership_bce, positions_or_arange
from hydra_model.routing_rules import RoutingRule, add_aux, merge_aux, register_routing, soft_mod


@register_routing
class ExpertChoiceRouting(RoutingRule):
    name = "expert_choice"
    selects_tokens = True

    def mod_forward(self, wrapper, h, pos, ctx):
        if wrapper.capacity >= 1.0:
            return soft_mod(wrapper, h, pos, ctx)
        b, s, _ = h.shape
        bce = wrapper.training
        logit, bce_logit = router_logits(
            h, wrapper.router.weight[0], wrapper.router.bias[0], with_detached=bce
        )
        weight = torch.sigmoid(logit)
        aux = {}
        all_pos = positions_or_arange(pos, b, s, h.device)
        if wrapper.training:
            view = SubSequence.top_k(logit.detach(), math.ceil(wrapper.capacity * s), all_pos)
            selected = torch.zeros(b, s, dtype=torch.bool, device=h.device).scatter(1, view.idx, True)
            add_aux(aux, "mod_router", membership_bce(bce_logit, selected, None))
        else:
            selected = logit > 0  # σ(logit) > ½, decided by the token alone: causal
            view = SubSequence.permuted(selected, all_pos)
        hs = view.gather(h)
        hs_out, inner = wrapper.mor(hs, view.pos, view.member, ctx)
        merge_aux(aux, inner)
        if view.member is None:
            new_h = gated_scatter(h, view.flat, view.idx, weight, hs_out, hs)
        else:
            new_h = view.scatter_add(h, view.gather_values(weight).unsqueeze(-1) * (hs_out - hs))
        if not ctx.generating:
            frac = selected.float().mean()
            wrapper.record_stats(frac, weight, frac)
        return new_h, aux

    def mor_forward(self, block, h, pos, member, ctx, aux):
        b, n, _ = h.shape
        active = member  # None: every row is a candidate
        depth = torch.zeros(b, n, device=h.device)
        expected = torch.zeros(b, n, device=h.device)
        reach = torch.ones(b, n, device=h.device)  # P(token reaches recursion r), for expected depth
        all_pos = None
        for r, cap in enumerate(block.capacities):
            routed_training = block.training and cap < 1.0
            logit, bce_logit = block.logits(h, r, bce=routed_training)
            if routed_training:
                # top-k among the active tokens, gates, aux terms and running statistics in one
                # fused call; the router learns membership from the token alone (bce_logit)
                all_pos = positions_or_arange(pos, b, n, h.device) if all_pos is None else all_pos
                k = math.ceil(cap * n)
                picked = expert_choice_select(
                    logit, bce_logit, active, all_pos, reach, depth, expected, k, block.alpha
                )
                gate, idx, flat, sel_pos, selected, z_loss, bce, reach, depth, expected = picked
                add_aux(aux, "router_z", z_loss)
                add_aux(aux, "mor_router", bce)
                view = SubSequence(idx, sel_pos, None, flat)
                h, moe_loss = block.run_block(h, r, ctx, pos, gate, view=view)
                add_aux(aux, "moe_balance", moe_loss)
                active = selected
                continue
            prob = torch.sigmoid(logit)
            gate = block.alpha * prob
            add_aux(aux, "router_z", masked_mean(logit.pow(2), active))
            if cap >= 1.0:
                h, moe_loss = block.run_block(h, r, ctx, pos, gate, member=active)
                selected = active
            else:
                # eval: causal threshold routing over the selected-first permutation
                all_pos = positions_or_arange(pos, b, n, h.device) if all_pos is None else all_pos
                reach = reach * prob
                selected = logit > 0 if active is None else (logit > 0) & active
                view = SubSequence.permuted(selected, all_pos)
                h, moe_loss = block.run_block(h, r, ctx, pos, gate, view=view)
            add_aux(aux, "moe_balance", moe_loss)
            depth = depth + (1.0 if selected is None else selected.float())
            expected = expected + reach
            active = selected
        return h, depth, expected
