"""HYDRA's inference forward in plain PyTorch, for Hugging Face transformers (remote code).

Shipped into every ``hydra-model export-hf`` folder of a HYDRA model and loaded by
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``. It imports torch and
transformers only, so the folder loads where HYDRA is not installed. It is an independent
implementation of what ``hydra_model.CCGQAMoDMoRModel`` computes in ``eval()`` mode, checked
against it by tests/hydra_model/test_hf_export_hydra.py on several configurations; the module
tree and parameter names are HYDRA's, so the exported weights load one to one.

What each block does comes from ``config.layout`` (written by the exporter from the model
instance, see configuration_hydra.py):

* CCGQA attention in a compressed latent space: packed [q; k] down-projection, a causal depthwise
  conv along the sequence then a head-wise grouped conv (left zero padding only), plus the q-k
  mean of the pre-conv projections; value shift (half the value channels from the previous
  token); QK norm (√d/‖·‖, keys × exp(temperature)); partial rotate-half RoPE; causal GQA.
* Routing at inference, all causal (a token's output never depends on later tokens):
  ``causal`` routing points take a token when its router logit clears the saved threshold τ and
  fewer than ⌈c·(t+1)⌉ tokens at positions ≤ t are already taken; ``threshold`` points (the
  expert-choice ablation's evaluation rule) take it when σ(logit) > ½; ``soft`` MoD mixes every
  token by σ(logit); token-choice MoR picks a depth per token. Routed tokens run as a
  sub-sequence (in time order, keeping their positions), and the update is gated by the router.

Inference and evaluation only: training HYDRA (threshold tracking, auxiliary losses) is
hydra-train's. There is no incremental cache: generation reruns the whole prefix each step
(correct, slower). Only right padding is supported (every output depends on earlier tokens only,
so padding after a sequence changes nothing before it); left padding would shift the positions
routing budgets count, and is refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_hydra import HydraHFConfig

#: QK norm's floor on ‖x‖ (an all-zero head stays zero)
QK_NORM_EPS = 1e-6
#: routers score the stream RMS-normalised with this epsilon
ROUTER_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(rotary_dim: int, base: float, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., R/2] (fp32) for integer positions ``pos``; angles in fp64 first."""
    half = rotary_dim // 2
    exponents = torch.arange(half, device=pos.device, dtype=torch.float64) * 2 / max(1, rotary_dim)
    angles = pos.to(torch.float64).unsqueeze(-1) * (base**-exponents)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2·cos.shape[-1] channels of x [B, n, H, D]; cos [B, n, R/2]."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, n, Hq, d], k/v [B, n, Hkv, d] → [B, n, Hq·d]; query head h reads kv head h // G."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if groups > 1:
        kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


class CCGQAAttention(nn.Module):
    def __init__(self, dim: int, spec: dict) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec["n_heads"], spec["n_kv_heads"], spec["head_dim"]
        self.rotary_dim = spec["rotary_dim"]
        d = self.head_dim
        self.q_dim, self.kv_dim = self.n_heads * d, self.n_kv_heads * d
        c = self.q_dim + self.kv_dim
        self.k_seq, self.k_ch = spec["conv_kernel_seq"], spec["conv_kernel_ch"]
        self.w_qkv = nn.Linear(dim, c + self.kv_dim, bias=False)
        self.conv_seq = nn.Conv1d(c, c, self.k_seq, groups=c)
        self.conv_ch = nn.Conv1d(c, c, self.k_ch, groups=self.n_heads + self.n_kv_heads)
        self.temperature = nn.Parameter(torch.zeros(self.n_kv_heads))
        self.w_o = nn.Linear(self.q_dim, dim, bias=False)

    def _qk_mean(self, u: torch.Tensor) -> torch.Tensor:
        """Query head h: (q_pre[h] + k_pre[h // G]) / 2; kv head g: the mean of those over its group."""
        b, n, _ = u.shape
        groups = self.n_heads // self.n_kv_heads
        q = u[..., : self.q_dim].reshape(b, n, self.n_kv_heads, groups, self.head_dim)
        k = u[..., self.q_dim :].reshape(b, n, self.n_kv_heads, 1, self.head_dim)
        q_mix = (q + k) / 2
        k_mix = q_mix.mean(dim=3)
        return torch.cat([q_mix.reshape(b, n, self.q_dim), k_mix.reshape(b, n, self.kv_dim)], dim=-1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope_base: float) -> torch.Tensor:
        b, n, _ = x.shape
        d, half = self.head_dim, self.kv_dim // 2
        u, v_cur, v_src = self.w_qkv(x).split([self.q_dim + self.kv_dim, half, half], dim=-1)
        # causal convs: left-pad by both kernels' context once, run both convs unpadded
        context = (self.k_seq - 1) + (self.k_ch - 1)
        padded = F.pad(u.transpose(1, 2), (context, 0))
        qk = self.conv_ch(self.conv_seq(padded)).transpose(1, 2) + self._qk_mean(u)
        q, k = qk.split([self.q_dim, self.kv_dim], dim=-1)
        q, k = q.reshape(b, n, self.n_heads, d), k.reshape(b, n, self.n_kv_heads, d)
        v_prev = F.pad(v_src[:, :-1], (0, 0, 1, 0))  # x_{t−1}·W_v2, zero at the first token
        v = torch.cat([v_cur, v_prev], dim=-1).reshape(b, n, self.n_kv_heads, d)
        q = _qk_norm(q, math.sqrt(d), None)
        k = _qk_norm(k, math.sqrt(d), self.temperature)
        if self.rotary_dim:
            cos, sin = rope_tables(self.rotary_dim, rope_base, pos)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.w_o(causal_attention(q, k, v, 1.0 / math.sqrt(d)))


def _qk_norm(x: torch.Tensor, scale: float, temperature: torch.Tensor | None) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).clamp_min(QK_NORM_EPS**2)) * scale
    if temperature is not None:
        y = y * temperature.float().exp().unsqueeze(-1)
    return y.to(x.dtype)


class GQAAttention(nn.Module):
    """Plain GQA (the routing-off ablation's attention): no convs, no QK norm, partial RoPE."""

    def __init__(self, dim: int, spec: dict) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec["n_heads"], spec["n_kv_heads"], spec["head_dim"]
        self.rotary_dim = spec["rotary_dim"]
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.w_qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim, bias=False)
        self.w_o = nn.Linear(self.q_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope_base: float) -> torch.Tensor:
        b, n, _ = x.shape
        d = self.head_dim
        q, k, v = self.w_qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q, k = q.reshape(b, n, self.n_heads, d), k.reshape(b, n, self.n_kv_heads, d)
        v = v.reshape(b, n, self.n_kv_heads, d)
        if self.rotary_dim:
            cos, sin = rope_tables(self.rotary_dim, rope_base, pos)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.w_o(causal_attention(q, k, v, 1.0 / math.sqrt(d)))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, spec: dict) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(dim, 2 * spec["hidden"], bias=False)
        self.w_down = nn.Linear(spec["hidden"], dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate_up(x)))


class MoEFFN(nn.Module):
    """Top-1/2 softmax-routed SwiGLU experts (top-2 weights renormalised); with loss-free
    balancing a per-expert bias is added to the scores for the selection only."""

    def __init__(self, dim: int, spec: dict) -> None:
        super().__init__()
        self.dim, self.n_experts, self.top_k = dim, spec["n_experts"], spec["top_k"]
        self.loss_free = spec["balancing"] == "loss_free"
        self.router = nn.Linear(dim, self.n_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(self.n_experts, dim, 2 * spec["hidden"]))
        self.w_down = nn.Parameter(torch.empty(self.n_experts, spec["hidden"], dim))
        self.register_buffer("balance_bias", torch.zeros(self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1, self.dim)
        probs = self.router(xf).float().softmax(dim=-1)
        scores = probs + self.balance_bias if self.loss_free else probs
        top = scores.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = probs.gather(1, top)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(xf)
        for e in range(self.n_experts):
            rows, slot = (top == e).nonzero(as_tuple=True)
            if rows.numel():
                out = swiglu(xf[rows] @ self.w_gate_up[e]) @ self.w_down[e]
                y = y.index_add(0, rows, out * weights[rows, slot].unsqueeze(-1).to(out.dtype))
        return y.reshape(x.shape)


class CCGQABlock(nn.Module):
    """Pre-norm attention + FFN; returns the update attn + ffn(norm2(h + attn))."""

    def __init__(self, dim: int, spec: dict) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, spec["norm_eps"])
        self.norm2 = RMSNorm(dim, spec["norm_eps"])
        attn = spec["attention"]
        self.attn = (CCGQAAttention if attn["kind"] == "ccgqa" else GQAAttention)(dim, attn)
        self.ffn = (MoEFFN if spec["ffn"]["kind"] == "moe" else SwiGLUMLP)(dim, spec["ffn"])

    def forward(self, h: torch.Tensor, pos: torch.Tensor, rope_base: float) -> torch.Tensor:
        a = self.attn(self.norm1(h), pos, rope_base)
        return a + self.ffn(self.norm2(a + h))


class RouterThreshold(nn.Module):
    """The saved threshold τ of a causal routing point (``spread`` and ``seen`` are training state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tau", torch.zeros(()))
        self.register_buffer("spread", torch.ones(()))
        self.register_buffer("seen", torch.zeros(()))


class CausalRouter(nn.Module):
    def __init__(self, cap_q: int, capacity_bits: int) -> None:
        super().__init__()
        self.cap_q, self.bits = cap_q, capacity_bits
        self.threshold = RouterThreshold()

    def decide(self, logit: torch.Tensor, pos: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        """Taken tokens [B, n]: above τ and within the budget ⌈c·(t+1)⌉ of taken tokens up to t."""
        passed = logit > self.threshold.tau
        if candidates is not None:
            passed = passed & candidates
        one = 1 << self.bits
        budget = (((pos + 1) * self.cap_q + (one - 1)) >> self.bits).cummax(-1).values
        taken_so_far = passed.long().cumsum(-1)
        count = taken_so_far + (budget - taken_so_far).cummin(-1).values.clamp(max=0)
        return count > F.pad(count[:, :-1], (1, 0))


def router_logit(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A linear router on the RMS-normalised stream, in fp32: [B, n]."""
    hf = h.float()
    inv = torch.rsqrt(hf.pow(2).mean(-1) + ROUTER_EPS)
    return torch.addcmul(bias.float(), hf @ weight.float(), inv)


def run_on(selected: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, fn) -> tuple:
    """Run ``fn(h_sub, pos_sub, member)`` on the selected tokens of each sequence as a sub-sequence:
    a stable permutation puts them first (time order kept), so a causal ``fn`` computes exactly
    the sub-sequence on the prefix. Returns (perm [B, n], member [B, n] mask of the prefix,
    the permuted input, fn's output)."""
    n = selected.shape[1]
    t = torch.arange(n, device=h.device)
    perm = torch.where(selected, t, t + n).argsort(dim=-1)
    member = t.unsqueeze(0) < selected.sum(dim=1, keepdim=True)
    hs = h.gather(1, perm.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
    return perm, member, hs, fn(hs, pos.gather(1, perm), member)


def add_back(h: torch.Tensor, perm: torch.Tensor, member: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """h plus the permuted ``update`` [B, n, E] at its original rows, member rows only."""
    update = torch.where(member.unsqueeze(-1), update, torch.zeros_like(update)).to(h.dtype)
    return h.scatter_add(1, perm.unsqueeze(-1).expand(-1, -1, h.shape[-1]), update)


class MoRBlock(nn.Module):
    """One shared block applied up to R times; how deep each token goes follows ``spec["kind"]``."""

    def __init__(self, dim: int, spec: dict, capacity_bits: int, rope_base: float) -> None:
        super().__init__()
        self.kind, self.recursions, self.alpha = spec["kind"], spec["recursions"], spec["alpha"]
        self.capacities = spec.get("capacities")
        self.rope_base = rope_base
        self.block = CCGQABlock(dim, spec["block"])
        self.router = nn.Linear(dim, self.recursions) if spec["router"] else None
        self.causal = nn.ModuleDict(
            {r: CausalRouter(q, capacity_bits) for r, q in (spec.get("causal_cap_q") or {}).items()}
        )

    def _update(self, h, pos, gate, selected=None):
        """h + gate·block(h) on every row (``selected`` None) or on the selected sub-sequence."""
        if selected is None:
            delta = self.block(h, pos, self.rope_base)
            return h + delta if gate is None else torch.addcmul(h, gate.unsqueeze(-1).to(h.dtype), delta)
        perm, member, _, delta = run_on(
            selected, h, pos, lambda hs, ps, _m: self.block(hs, ps, self.rope_base)
        )
        return add_back(h, perm, member, gate.gather(1, perm).unsqueeze(-1) * delta)

    def _logit(self, h, r):
        return router_logit(h, self.router.weight[r], self.router.bias[r])

    def forward(self, h: torch.Tensor, pos: torch.Tensor, member: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "dense":
            for _ in range(self.recursions):
                h = self._update(h, pos, None)
            return h
        if self.kind == "static":
            for r in range(self.recursions):
                h = self._update(h, pos, self.alpha * torch.sigmoid(self._logit(h, r)))
            return h
        if self.kind == "token_choice":
            normed = F.rms_norm(h, (h.shape[-1],), eps=ROUTER_EPS)
            probs = self.router(normed).float().softmax(dim=-1)  # [B, n, R]: depth 1..R
            choice = probs.argmax(dim=-1)
            gate = self.alpha * probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
            h = self._update(h, pos, gate)
            for r in range(1, self.recursions):
                selected = choice + 1 > r if member is None else (choice + 1 > r) & member
                h = self._update(h, pos, gate, selected)
            return h
        active = member  # causal or expert choice: recursion r picks among recursion r−1's tokens
        for r in range(self.recursions):
            logit = self._logit(h, r)
            gate = self.alpha * torch.sigmoid(logit)
            if self.kind == "causal":
                router = self.causal[str(r)] if str(r) in self.causal else None  # noqa: SIM401
                if router is None:  # capacity 1: every candidate
                    h, taken = self._update(h, pos, gate), active
                else:
                    taken = router.decide(logit, pos, active)
                    h = self._update(h, pos, gate, taken)
            elif self.capacities[r] >= 1.0:
                h, taken = self._update(h, pos, gate), active
            else:  # expert choice evaluated: σ(logit) > ½ among the candidates
                taken = logit > 0 if active is None else (logit > 0) & active
                h = self._update(h, pos, gate, taken)
            active = taken
        return h


class MoDBlock(nn.Module):
    """Mixture-of-Depths around a MoR block: ``spec["kind"]`` none | soft | threshold | causal."""

    def __init__(self, dim: int, spec: dict, capacity_bits: int, rope_base: float) -> None:
        super().__init__()
        self.kind = spec["mod"]["kind"]
        self.mor = MoRBlock(dim, spec["mor"], capacity_bits, rope_base)
        self.router = nn.Linear(dim, 1) if self.kind != "none" else None
        self.causal = CausalRouter(spec["mod"]["cap_q"], capacity_bits) if self.kind == "causal" else None

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.kind == "none":
            return self.mor(h, pos, None)
        logit = router_logit(h, self.router.weight[0], self.router.bias[0])
        weight = torch.sigmoid(logit)
        if self.kind == "soft":
            return torch.lerp(h, self.mor(h, pos, None).to(h.dtype), weight.unsqueeze(-1).to(h.dtype))
        selected = self.causal.decide(logit, pos, None) if self.kind == "causal" else logit > 0
        perm, member, hs, out = run_on(selected, h, pos, self.mor)
        return add_back(h, perm, member, weight.gather(1, perm).unsqueeze(-1) * (out - hs))


class HydraPreTrainedModel(PreTrainedModel):
    config_class = HydraHFConfig
    base_model_prefix = "hydra"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh (not loaded) weights: normal(0, 0.02), zero biases, unit norms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MoEFFN):
            module.w_gate_up.normal_(0.0, 0.02)
            module.w_down.normal_(0.0, 0.02)


class HydraForCausalLM(HydraPreTrainedModel, GenerationMixin):
    """The HYDRA decoder with its tied LM head; ``forward(input_ids, labels=None)``."""

    def __init__(self, config: HydraHFConfig) -> None:
        super().__init__(config)
        layout = config.layout
        dim, bits = config.hidden_size, layout["capacity_bits"]
        rope_base = layout["rope_base"]
        self.embed = nn.Embedding(config.vocab_size, dim)
        self.blocks = nn.ModuleList(MoDBlock(dim, spec, bits, rope_base) for spec in layout["blocks"])
        self.norm = RMSNorm(dim, layout["norm_eps"])
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **_unused,
    ) -> CausalLMOutputWithPast:
        """Logits [B, S, V] of every position; with ``labels`` the mean next-token cross-entropy
        (labels shifted inside, −100 ignored). Cache arguments are accepted and ignored; an
        attention mask may only pad on the right (the padded positions' outputs are junk)."""
        if attention_mask is not None and not bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
            # right padding is harmless: every output depends on earlier tokens only
            raise ValueError(
                "HYDRA's exported model does not support left padding or holes in the attention "
                "mask (routing budgets count positions from the first token): pad on the right"
            )
        b, s = input_ids.shape
        pos = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, pos)
        logits = F.linear(self.norm(h), self.embed.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask=None, **_unused
    ) -> dict:
        """The whole sequence at every step (no incremental cache). Generation appends each new
        token after the whole row, so a padded row would continue after its padding: batched
        generation takes rows of equal length only (a padded batch is refused, with this reason)."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "HYDRA's exported model generates from unpadded rows only (new tokens would follow "
                "the padding): generate each prompt on its own, or batch prompts of equal length"
            )
        return {"input_ids": input_ids, "attention_mask": attention_mask}
