"""Mixture-of-Experts SwiGLU FFN: top-1/2 routing, sorted dropless dispatch, grouped matmul.

Assignments are sorted by expert so each expert's tokens are contiguous; one grouped matmul per
projection then runs every expert at once (``torch._grouped_mm``, on CUDA sm_90+ in bf16 with
16-aligned widths). Elsewhere a correct fallback runs: a per-expert loop over the sorted slices
in eager mode (one host sync for the slice sizes), or, under torch.compile / CUDA-graph capture
where syncs are not allowed, every expert on every sorted row with the other rows masked out
(fixed shapes, n_experts × the FLOPs). :func:`moe_dispatch_counts` says which ran.

Balancing: ``aux_loss`` (Switch: n_experts · Σ_e f_e · P_e) or ``loss_free`` (a per-expert bias
added to the scores for selection only, nudged by ±rate towards equal load after each training
forward with gradients; DeepSeek-V3 style).
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from hydra_kernels import swiglu, swiglu_packed
from hydra_model.config import MOE_BALANCINGS

_lock = threading.Lock()
_dispatch_counts: Counter[str] = Counter()
#: "auto" picks per call; tests force a path to check each against a per-token loop
_forced_dispatch: dict[str, str | None] = {"path": None}
DISPATCH_PATHS = ("grouped_mm", "loop", "masked")


def moe_dispatch_counts() -> dict[str, int]:
    """How many MoE FFN calls ran each dispatch path (grouped_mm | loop | masked) since import."""
    return dict(_dispatch_counts)


def reset_moe_dispatch_counts() -> None:
    _dispatch_counts.clear()


def force_moe_dispatch(path: str | None) -> None:
    """Force a dispatch path (None restores automatic choice). Raises if the path is unknown."""
    if path is not None and path not in DISPATCH_PATHS:
        raise ValueError(f"unknown MoE dispatch path {path!r}; expected one of {DISPATCH_PATHS}")
    _forced_dispatch["path"] = path


def _grouped_mm_valid(x: torch.Tensor, widths: tuple[int, ...]) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return x.dtype == torch.bfloat16 and all(w % 16 == 0 for w in widths)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _zero_load_when_absent(module, state_dict, prefix, *args) -> None:
    """A state dict saved before ``pending_load`` was kept loads it as zeros (no pending update)."""
    state_dict.setdefault(prefix + "pending_load", torch.zeros_like(module.pending_load))


class MoEFFN(nn.Module):
    """Sparse SwiGLU experts on x [..., E]; returns (y [..., E], balance loss or None)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int = 1,
        balancing: str = "aux_loss",
        bias_update_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        if n_experts < 1 or not 1 <= top_k <= n_experts:
            raise ValueError(
                f"MoEFFN: top_k={top_k} experts per token out of n_experts={n_experts}: "
                "need 1 ≤ top_k ≤ n_experts"
            )
        if balancing not in MOE_BALANCINGS:
            raise ValueError(f"MoEFFN: balancing={balancing!r}; expected one of {MOE_BALANCINGS}")
        self.dim, self.hidden, self.n_experts, self.top_k = dim, hidden, n_experts, top_k
        self.balancing, self.bias_update_rate = balancing, bias_update_rate
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))  # [n_exp, E, 2H]
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, dim))  # [n_exp, H, E]
        nn.init.normal_(self.w_gate_up, std=0.02)
        nn.init.normal_(self.w_down, std=0.02)
        #: loss-free balancing bias (selection only); persistent so training resumes exactly
        self.register_buffer("balance_bias", torch.zeros(n_experts))
        #: assignments since the last bias update: persistent too, since the next training forward
        #: turns the last step's load into a bias update (a resume without it skipped that update)
        self.register_buffer("pending_load", torch.zeros(n_experts))
        self.register_load_state_dict_pre_hook(_zero_load_when_absent)
        # this forward's statistics
        self.register_buffer("stat_load", torch.zeros(n_experts), persistent=False)
        self.register_buffer("stat_entropy", torch.zeros(2), persistent=False)  # [Σ entropy, tokens]

    # --- bookkeeping outside the hot path ---------------------------------------------------
    @torch.no_grad()
    def apply_bias_update(self) -> None:
        """Loss-free balancing: move each expert's bias towards equal load (no host sync)."""
        load = self.pending_load
        step = torch.sign(load.mean() - load) * self.bias_update_rate
        self.balance_bias.add_(torch.where(load.sum() > 0, step, torch.zeros_like(step)))
        self.pending_load.zero_()

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.stat_load.zero_()
        self.stat_entropy.zero_()

    def routing_stats(self) -> dict[str, torch.Tensor]:
        """Entropy (mean per-token router entropy, nats), utilisation [E] (share of assignments),
        KL(utilisation ‖ uniform), max violation (max_e util_e·E − 1)."""
        total = self.stat_load.sum().clamp_min(1.0)
        util = self.stat_load / total
        kl = (util * (util.clamp_min(1e-12) * self.n_experts).log()).sum()
        return {
            "entropy": self.stat_entropy[0] / self.stat_entropy[1].clamp_min(1.0),
            "utilization": util,
            "kl_to_uniform": kl,
            "max_violation": util.max() * self.n_experts - 1.0,
        }

    # --- forward ------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., E]; ``valid`` [...] bool marks real tokens (statistics and losses skip the rest)."""
        shape = x.shape
        xf = x.reshape(-1, self.dim)  # [T, E]
        n_tok, k = xf.shape[0], self.top_k
        logits = self.router(xf).float()  # [T, n_exp]
        probs = logits.softmax(dim=-1)
        scores = probs + self.balance_bias if self.balancing == "loss_free" else probs
        top_e = scores.topk(k, dim=-1).indices  # [T, k]
        weights = probs.gather(1, top_e)  # [T, k]
        if k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        flat_e = top_e.reshape(-1)  # [T·k]
        order = torch.argsort(flat_e, stable=True)  # assignments grouped by expert
        token_of = order // k  # [T·k]
        sorted_e = flat_e[order]
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device)
        counts = counts.scatter_add(0, flat_e, torch.ones_like(flat_e))

        dtype = _compute_dtype(xf)
        xs = xf[token_of].to(dtype)  # [T·k, E]
        ys = self._experts(xs, sorted_e, counts)  # [T·k, E]
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        y = torch.zeros(n_tok, self.dim, dtype=ys.dtype, device=x.device).index_add(0, token_of, ys)

        vmask = None if valid is None else valid.reshape(-1).to(probs.dtype)  # [T]
        assign = F.one_hot(flat_e, self.n_experts).to(probs.dtype)  # [T·k, n_exp]
        if vmask is not None:
            assign = assign * vmask.repeat_interleave(k).unsqueeze(-1)
        load = assign.sum(0)  # [n_exp]
        trains = self.training and torch.is_grad_enabled()  # a forward that trains (model.py)
        with torch.no_grad():
            ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
            n_valid = vmask.sum() if vmask is not None else torch.full((), float(n_tok), device=x.device)
            self.stat_load.add_(load)
            self.stat_entropy.add_(
                torch.stack([(ent * vmask).sum() if vmask is not None else ent.sum(), n_valid])
            )
            if trains:
                self.pending_load.add_(load)

        loss = None
        if self.balancing == "aux_loss" and self.training:
            frac = load.detach() / load.sum().clamp_min(1.0)  # f_e
            p_mean = (
                (probs * vmask.unsqueeze(-1)).sum(0) / vmask.sum().clamp_min(1.0)
                if vmask is not None
                else probs.mean(0)
            )
            loss = self.n_experts * (frac * p_mean).sum()
        return y.reshape(shape).to(x.dtype), loss

    def _experts(self, xs: torch.Tensor, sorted_e: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        path = _forced_dispatch["path"]
        if path is None:
            if _grouped_mm_valid(xs, (self.dim, 2 * self.hidden, self.hidden)):
                path = "grouped_mm"
            elif torch.compiler.is_compiling() or (xs.is_cuda and torch.cuda.is_current_stream_capturing()):
                path = "masked"
            else:
                path = "loop"
        if not torch.compiler.is_compiling():
            with _lock:
                _dispatch_counts[path] += 1
        w_gu, w_dn = self.w_gate_up.to(xs.dtype), self.w_down.to(xs.dtype)
        h = self.hidden
        if path == "grouped_mm":
            offs = counts.cumsum(0).to(torch.int32)
            gu = torch._grouped_mm(xs, w_gu, offs=offs)  # [T·k, 2H]
            return torch._grouped_mm(swiglu_packed(gu), w_dn, offs=offs)
        if path == "loop":
            outs = []
            for e, rows in enumerate(xs.split(counts.tolist(), dim=0)):  # host sync: slice sizes
                gu = rows @ w_gu[e]
                outs.append(swiglu(gu[:, :h], gu[:, h:]) @ w_dn[e])
            return torch.cat(outs, dim=0)
        out = xs.new_zeros(xs.shape[0], self.dim)
        for e in range(self.n_experts):  # every expert on every row, others masked (no sync)
            gu = xs @ w_gu[e]
            mine = (sorted_e == e).unsqueeze(-1).to(xs.dtype)
            out = out + mine * (swiglu(gu[:, :h], gu[:, h:]) @ w_dn[e])
        return out
