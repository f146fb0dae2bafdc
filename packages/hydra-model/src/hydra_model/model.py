"""CCGQAMoDMoRModel: embedding → MoD-wrapped MoR blocks → final norm → tied LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hydra_model.blocks import CCGQAMoDBlockWrapper, RunContext
from hydra_model.cache import ModelCache
from hydra_model.causal_routing import RouterThreshold, commit_thresholds
from hydra_model.ccgqa import CCGQAAttention, list_conv_modules
from hydra_model.ccgqa_fold import fold_blocks
from hydra_model.checkpointing import GradientCheckpointMixin
from hydra_model.config import HydraConfig, preset_config
from hydra_model.decoder import DecoderMixin, check_return_logits
from hydra_model.gqa import GQAAttention
from hydra_model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from hydra_model.moe import MoEFFN
from hydra_model.routing_rules import AuxLists, merge_aux


@dataclass
class HydraOutput:
    """``logits`` [B, S, V] (None when chunked CE skipped them); with targets: ``loss`` (what
    training backpropagates: ce + weighted aux), ``ce_loss`` and the unweighted ``aux_losses``."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


def check_forward_inputs(
    input_ids: torch.Tensor, targets: torch.Tensor | None, vocab_size: int
) -> torch.Tensor | None:
    """Refuse what a forward cannot read, naming it (both architectures' forwards call this):
    ``input_ids`` must be integer ids [batch, seq] with seq ≥ 1, ``targets`` (when given) integer
    ids of the same shape (another shape of as many numbers was paired with the wrong
    positions). Returns the targets as int64 (cross-entropy takes no int32). Ids past the
    vocabulary are named on the CPU in eager mode; elsewhere the check would read the ids back
    to the host each forward, and the embedding's own error (a device-side assert) stays."""
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)}: a forward takes [batch, seq] token ids "
            "(one sequence: input_ids.unsqueeze(0))"
        )
    if input_ids.shape[1] == 0:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} holds no tokens; pass seq ≥ 1")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids are {input_ids.dtype}; pass integer token ids (e.g. .long())")
    # plain CPU tensors only: a FakeTensor (FLOP counting, export) or another subclass has no
    # values to read, and on a GPU the read would be a host sync every forward
    # (is_compiling first: a traced forward never evaluates the rest)
    plain = not torch.compiler.is_compiling() and type(input_ids) is torch.Tensor
    if plain and input_ids.device.type == "cpu" and input_ids.numel():
        low, high = (int(v) for v in torch.aminmax(input_ids))
        bad = low if low < 0 else high
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"input_ids hold {bad}, outside the vocabulary: ids must lie in "
                f"[0, vocab_size={vocab_size}); check the tokenizer against the config's vocab_size"
            )
    if targets is None:
        return None
    if targets.shape != input_ids.shape:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} must have input_ids' shape "
            f"{tuple(input_ids.shape)}: one target per position (ignore_index -100 to skip one)"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets are {targets.dtype}; pass integer token ids (-100 to ignore)")
    return targets.long()


def aux_loss_weights(cfg: HydraConfig) -> dict[str, float]:
    """Weight of each auxiliary term in ``loss`` (the terms in ``aux_losses`` are unweighted)."""
    return {
        "mod_router": cfg.mod_aux_weight,
        "mor_router": cfg.mor_aux_weight,
        "router_z": cfg.router_z_weight,
        "ponder": cfg.ponder_weight,
        "mor_balance": cfg.mor_balance_weight,
        "moe_balance": cfg.moe_aux_weight,
    }


class CCGQAMoDMoRModel(nn.Module, GradientCheckpointMixin, DecoderMixin):
    """The HYDRA decoder. With ``routing="causal"`` (the default) training, evaluation and
    decoding route by the same causal rule (causal_routing.py): logits at t never see tokens
    after t, in any mode. ``routing="expert_choice"`` (an ablation) routes training by top-k over
    each sequence, as the MoD and MoR papers do, and evaluation by causal thresholds."""

    def __init__(self, config: HydraConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.rope = (
            RotaryEmbedding(config.rotary_dim, config.max_seq_len, config.rope_base)
            if config.rotary_dim
            else None
        )
        self.blocks = nn.ModuleList(CCGQAMoDBlockWrapper(config, i) for i in range(config.n_mor_blocks))
        #: who commits the causal routing thresholds: "forward" (each training forward, the
        #: default) or "manual" (the training loop, via commit_router_thresholds)
        self.threshold_commit = "forward"
        # DDP broadcasts buffers from rank 0 at every forward; the thresholds' per-step records
        # are per-rank sums (all-reduced before a commit) and must not be overwritten between
        # micro-batches
        self._ddp_params_and_buffers_to_ignore = [
            name for name, _ in self.named_buffers() if name.endswith((".above", ".moments"))
        ]
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.reset_parameters()

    # --- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) everywhere; residual output projections scaled by 1/√(2·depth),
        depth counting every recursion, so the residual stream's variance stays O(1)."""
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.effective_depth)
        nn.init.normal_(self.embed.weight, std=std)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Conv1d):
                mod.reset_parameters()
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
        for mod in self.modules():
            if isinstance(mod, (CCGQAAttention, GQAAttention)):
                nn.init.normal_(mod.w_o.weight, std=resid_std)
                if isinstance(mod, CCGQAAttention):
                    nn.init.zeros_(mod.temperature)
            elif isinstance(mod, SwiGLUMLP):
                nn.init.normal_(mod.w_down.weight, std=resid_std)
            elif isinstance(mod, MoEFFN):
                nn.init.normal_(mod.w_gate_up, std=std)
                nn.init.normal_(mod.w_down, std=resid_std)
                mod.balance_bias.zero_()

    # --- forward --------------------------------------------------------------------------------
    def router_thresholds(self) -> list[RouterThreshold]:
        """The causal routing points' thresholds (empty for other routings); found once (the
        block structure never changes after construction) since every step asks."""
        found = self.__dict__.get("_thresholds")
        if found is None:
            found = [m for m in self.modules() if isinstance(m, RouterThreshold)]
            self.__dict__["_thresholds"] = found
        return found

    def commit_router_thresholds(self, applied: torch.Tensor | None = None) -> None:
        """Fold the last training forward's router statistics into the causal thresholds; with
        ``applied`` False (a bool tensor, e.g. the step's finiteness) drop them instead. A
        trainer that calls this after each optimizer step sets ``threshold_commit = "manual"``;
        by default (``"forward"``) every training forward commits the one before it."""
        commit_thresholds(self.router_thresholds(), applied)

    def router_threshold_records(self) -> list[torch.Tensor]:
        """The thresholds' pending records (additive sums): a data-parallel trainer all-reduces
        them (summing) before :meth:`commit_router_thresholds` so every rank commits the same τ."""
        return [t for thr in self.router_thresholds() for t in (thr.above, thr.moments)]

    def moe_layers(self) -> list[MoEFFN]:
        """The MoE layers, found once as :meth:`router_thresholds` are: every forward asks, and a
        walk of every module cost a batch-1 prefill about 0.25 ms on the host. A layer swapped in
        after the first forward is not seen (the block structure is fixed once built)."""
        found = self.__dict__.get("_moe_layers")
        if found is None:
            found = [m for m in self.modules() if isinstance(m, MoEFFN)]
            self.__dict__["_moe_layers"] = found
        return found

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: ModelCache | None = None,
        return_logits: bool = True,
    ) -> HydraOutput:
        """input_ids [B, S] → HydraOutput. ``targets`` [B, S] (ignore_index −100) adds the losses.
        ``cache`` (from :meth:`generate`) prefills when empty and decodes one token when not.
        ``return_logits=False`` (with targets): the output holds the losses only (see
        :func:`~hydra_model.decoder.check_return_logits`)."""
        check_return_logits(targets, return_logits)
        targets = check_forward_inputs(input_ids, targets, self.config.vocab_size)
        b, s = input_ids.shape
        cfg = self.config
        pos = None
        if cache is not None:
            if self.training:
                raise RuntimeError("decoding with a cache needs model.eval() (threshold routing)")
            if targets is not None:  # a generating forward skips the auxiliary losses (blocks.py)
                raise ValueError(
                    "a forward with a cache generates and takes no targets; compute the loss without one"
                )
            if cache.seq_len:
                if s != 1:
                    raise ValueError(f"a filled cache decodes one token at a time, got {s}")
                cache.check_room(s)
                pos = cache.positions(b, input_ids.device)  # [B, 1]
        elif s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={cfg.max_seq_len}")
        # routing state moves only with forwards that train (training mode, gradients on): a
        # training-mode forward under no_grad (an evaluation of training-mode routing) reads it
        trains = self.training and torch.is_grad_enabled()
        if trains and self.threshold_commit == "forward":
            self.commit_router_thresholds()  # last step's quantile, outside any checkpointed region
        moes = self.moe_layers()
        for moe in moes:
            if trains and moe.balancing == "loss_free":
                moe.apply_bias_update()  # from the previous forward's load, outside any checkpoint
            moe.reset_stats()

        list_conv_modules(self, cache)
        h = self.embed(input_ids)  # [B, S, E]
        ctx = RunContext(self.rope, cache, seq_len=s)
        if cache is None:  # a prefill's bank folds every module's conv weights together already
            ctx.convs = fold_blocks([block.mor.block.attn for block in self.blocks])
        aux_lists: AuxLists = {}
        for i, block in enumerate(self.blocks):
            h, aux = self.checkpointed_call(i, block, h, pos, ctx)
            merge_aux(aux_lists, aux)
        h = self.norm(h)
        if cache is not None:
            cache.advance(s)

        if targets is None:
            return HydraOutput(logits=F.linear(h, self.embed.weight))
        logits, ce = self.head_and_loss(h, targets, return_logits)
        aux_losses = {name: torch.stack(vals).mean() for name, vals in aux_lists.items()}
        weights = aux_loss_weights(cfg)
        loss = ce
        for name, value in aux_losses.items():
            if weights[name]:
                loss = loss + weights[name] * value
        return HydraOutput(logits=logits, loss=loss, ce_loss=ce, aux_losses=aux_losses)

    def decode_stages(
        self, cache: ModelCache, tokens: torch.Tensor, logits: torch.Tensor, flags: torch.Tensor | None = None
    ) -> list:
        """One decode step as stages (decode_graphs.py): the embedding, each block's stages (a
        routed block: its decision, then the block gated on it), the head. The residual stream
        lives in one buffer the stages update in place. ``flags``: a bool vector whose slots the
        routed blocks' decision flags take, in order (a slot per block at most)."""
        from hydra_model.decode_graphs import DecodeStage

        b = tokens.shape[0]
        h = torch.empty(b, 1, self.config.dim, dtype=self.embed.weight.dtype, device=tokens.device)
        pos = cache.positions(b, tokens.device)  # [B, 1], advanced in place by the head stage
        ctx = RunContext(self.rope, cache, seq_len=1, host_reads=False, flag_pool=flags)

        def embed() -> None:
            # the positions advanced in place since the last step: gather this step's rotary tables
            # here, in a stage every step runs, not in the first block that asks (a routed block's
            # stage may be skipped, and the blocks after it would read the last step's tables)
            ctx.forget_tables()
            ctx.tables(1, pos)
            # the lookup written into the stream buffer: one kernel, not a gather and a copy
            torch.index_select(self.embed.weight, 0, tokens.view(-1), out=h.view(b, -1))

        stages = [DecodeStage(embed)]
        for block in self.blocks:
            stages.extend(block.decode_stages(h, pos, ctx))

        def head() -> None:
            logits.copy_(F.linear(self.norm(h), self.embed.weight)[:, -1])
            cache.advance(1)

        stages.append(DecodeStage(head))
        return stages

    # --- introspection --------------------------------------------------------------------------
    def routing_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Per-layer routing statistics of the last forward, as detached tensors (no host sync). A
        forward with a cache (generation: the prompt's prefill and each decode step) records no
        MoD or MoR statistics: they stay those of the last forward without one."""
        out: dict[str, list[dict[str, Any]]] = {"mod": [], "mor": [], "moe": []}
        for i, blk in enumerate(self.blocks):
            if blk.routed:
                out["mod"].append(
                    {
                        "layer": i,
                        "selected_frac": blk.stat_mod[0].clone(),
                        "capacity": float(self.config.mod_capacity),
                        "router_prob_mean": blk.stat_mod[1].clone(),
                        "passed_frac": blk.stat_mod[2].clone(),
                    }
                )
            if blk.mor.records_depth:
                out["mor"].append(
                    {
                        "layer": i,
                        "avg_depth": blk.mor.stat_depth[0].clone(),
                        "expected_depth": blk.mor.stat_depth[1].clone(),
                        "depth_hist": blk.mor.stat_depth_hist.clone(),
                    }
                )
            if isinstance(blk.mor.block.ffn, MoEFFN):
                stats = {k: v.detach().clone() for k, v in blk.mor.block.ffn.routing_stats().items()}
                out["moe"].append({"layer": i, **stats})
        return out


def create_ccgqa_mod_mor_model(model_size: str = "debug", **overrides: Any) -> CCGQAMoDMoRModel:
    """The preset ``model_size`` (tiny, debug, 100M, 250M, 500M, 1B) with any HydraConfig field
    overridden, e.g. ``routing_off=True`` for the routing-off ablation of the same code."""
    return CCGQAMoDMoRModel(preset_config(model_size, **overrides))
