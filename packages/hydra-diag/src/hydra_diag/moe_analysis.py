"""``moe specialization`` and ``moe weight-balance``: what the experts of a MoE model learned.

**weight-balance** (CPU, checkpoint only): per MoE layer and expert, the norms of the expert's
gate/up and down weights and of its router row, their ratio to the layer's median, and their
drift from the initial scale (init_std·√fan for gate/up, the residual-scaled std for down).
An expert far below the median, or still at its initial scale, has had few tokens.

**specialization, weight-only** (CPU): pairwise cosine similarity of the experts' weights and of
the router rows, per layer. Similar experts have not specialised; similar router rows cannot
send different tokens to different experts.

**specialization, inference**: the model on data batches (CUDA when present, else the CPU). Per
layer and expert: share of assignments, mean router probability of the chosen expert, and, where
the layer saw the batch's tokens in order (the first recursion of an unrouted block), the most
frequent token ids per expert and the *token purity*: over token ids seen at least
``min_count`` times, the share of their occurrences that went to their most common expert
(1.0: the expert is a function of the token; compare with the largest expert share).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from hydra_diag.loading import batches_for, load_model, pick_device, require_hydra
from hydra_diag.output import DiagError, Progress, no_progress
from hydra_diag.router_probe import RouterProbe, restore_buffers, snapshot_buffers


def moe_layers(model) -> list[tuple[int, Any]]:
    """(block index, MoEFFN) for every block with experts."""
    from hydra_model import MoEFFN

    require_hydra(model, "MoE diagnostics")  # a DiagError, which the watchdog reports and goes on
    out = []
    for i, blk in enumerate(model.blocks):
        for mod in blk.modules():
            if isinstance(mod, MoEFFN):
                out.append((i, mod))
                break
    if not out:
        raise DiagError("the model has no MoE layers (train with --moe, or moe_enabled=true)")
    return out


def _cosine_matrix(rows: torch.Tensor) -> list[list[float]]:
    unit = torch.nn.functional.normalize(rows.double(), dim=-1)
    return (unit @ unit.T).tolist()


def _off_diagonal_mean(m: list[list[float]]) -> float | None:
    n = len(m)
    vals = [m[i][j] for i in range(n) for j in range(n) if i != j]
    return sum(vals) / len(vals) if vals else None


def weight_balance(
    checkpoint: str, low: float = 0.5, high: float = 2.0, progress: Progress = no_progress
) -> dict[str, Any]:
    """Per-expert weight norms of a checkpoint (see the module docstring)."""
    progress("loading the checkpoint on the CPU")
    loaded = load_model(checkpoint, "cpu")
    cfg = loaded.model.config
    init_std = cfg.init_std
    resid_std = init_std / math.sqrt(2 * cfg.effective_depth)
    layers, findings = [], []
    for i, moe in moe_layers(loaded.model):
        with torch.no_grad():
            gu = moe.w_gate_up.detach().float().flatten(1).norm(dim=1)  # [E]
            dn = moe.w_down.detach().float().flatten(1).norm(dim=1)
            rt = moe.router.weight.detach().float().norm(dim=1)
        gu_init = init_std * math.sqrt(moe.w_gate_up[0].numel())
        dn_init = resid_std * math.sqrt(moe.w_down[0].numel())
        med = float(gu.median())
        experts = []
        bad = [e for e in range(moe.n_experts) if not all(map(math.isfinite, (gu[e], dn[e], rt[e])))]
        if bad:  # NaN norms compare false with every bound: without this they pass as balanced
            findings.append(
                {
                    "severity": "error",
                    "kind": "nonfinite_weights",
                    "layer": i,
                    "message": f"experts {bad} hold NaN/Inf weights",
                }
            )
        for e in range(moe.n_experts):
            rel = float(gu[e]) / med if med > 0 else None
            experts.append(
                {
                    "expert": e,
                    "gate_up_norm": float(gu[e]),
                    "down_norm": float(dn[e]),
                    "router_norm": float(rt[e]),
                    "balance_bias": float(moe.balance_bias[e]),
                    "gate_up_vs_median": rel,
                    "gate_up_vs_init": float(gu[e]) / gu_init,
                    "down_vs_init": float(dn[e]) / dn_init,
                }
            )
            if rel is not None and (rel < low or rel > high):
                findings.append(
                    {
                        "severity": "warning",
                        "kind": "expert_norm_outlier",
                        "layer": i,
                        "message": f"expert {e}: gate/up norm {rel:.2f}x the layer median",
                    }
                )
        layers.append(
            {
                "layer": i,
                "experts": experts,
                "gate_up_imbalance": float(gu.max() / gu.min().clamp_min(1e-30)),
                "down_imbalance": float(dn.max() / dn.min().clamp_min(1e-30)),
                "router_imbalance": float(rt.max() / rt.min().clamp_min(1e-30)),
            }
        )
    return {
        "tool": "moe_weight_balance",
        "source": loaded.source,
        "step": loaded.step,
        "layers": layers,
        "findings": findings,
    }


def specialization_weights(checkpoint: str, progress: Progress = no_progress) -> dict[str, Any]:
    """Weight-only specialization: expert and router-row cosine similarities per layer (CPU)."""
    progress("loading the checkpoint on the CPU")
    loaded = load_model(checkpoint, "cpu")
    layers = []
    for i, moe in moe_layers(loaded.model):
        with torch.no_grad():
            w = torch.cat([moe.w_gate_up.detach().flatten(1), moe.w_down.detach().flatten(1)], dim=1)
            sim = _cosine_matrix(w)
            rsim = _cosine_matrix(moe.router.weight.detach())
        layers.append(
            {
                "layer": i,
                "expert_similarity": sim,
                "router_similarity": rsim,
                "mean_expert_similarity": _off_diagonal_mean(sim),
                "mean_router_similarity": _off_diagonal_mean(rsim),
            }
        )
    return {
        "tool": "moe_specialization",
        "mode": "weights",
        "source": loaded.source,
        "step": loaded.step,
        "layers": layers,
    }


def token_purity(pairs: list[tuple[int, int]], min_count: int) -> tuple[float | None, int]:
    """Share of occurrences of frequent tokens that went to their majority expert, and how many
    distinct tokens counted (``pairs``: (token id, expert) per assignment)."""
    by_token: dict[int, Counter] = {}
    for tok, e in pairs:
        by_token.setdefault(tok, Counter())[e] += 1
    hits = total = used = 0
    for c in by_token.values():
        n = sum(c.values())
        if n >= min_count:
            hits += max(c.values())
            total += n
            used += 1
    return (hits / total if total else None), used


def specialization_inference(
    checkpoint: str,
    dataset: str | None = None,
    tokenizer: str | None = None,
    batch_size: int = 8,
    seq_len: int = 256,
    n_batches: int = 4,
    routing: str = "eval",
    top_tokens: int = 5,
    min_count: int = 5,
    device: str = "auto",
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Per-expert token statistics from forwards on data (see the module docstring)."""
    dev = pick_device(device)
    progress("loading the checkpoint")
    loaded = load_model(checkpoint, dev)
    model = loaded.model
    layers_moe = moe_layers(model)
    seq_len = min(seq_len, model.config.max_seq_len)
    batches, data_desc = batches_for(
        model,
        dataset=dataset,
        train_config=loaded.train_config,
        batch_size=batch_size,
        seq_len=seq_len,
        n=n_batches,
        device=dev,
        tokenizer=tokenizer,
    )
    model.train(routing == "train")
    pairs: dict[int, list[tuple[int, int]]] = {i: [] for i, _ in layers_moe}
    saved = snapshot_buffers(model)
    with torch.no_grad(), RouterProbe(model, batch_tokens=batch_size * seq_len) as probe:
        for b, (x, _) in enumerate(batches):
            progress(f"batch {b + 1}/{len(batches)}")
            marks = {i: len(probe.moe[i].chosen) for i, _ in layers_moe}
            model(x)
            restore_buffers(model, saved)
            ids = x.reshape(-1).cpu()
            for i, _ in layers_moe:
                rec = probe.moe[i]
                for chosen, ordered in zip(rec.chosen[marks[i] :], rec.in_order[marks[i] :], strict=True):
                    if ordered:
                        for k in range(chosen.shape[1]):
                            pairs[i] += list(zip(ids.tolist(), chosen[:, k].tolist(), strict=True))
    model.eval()
    decode = _decoder(tokenizer, loaded)
    layers = []
    for i, moe in layers_moe:
        rec = probe.moe[i]
        counts = rec.counts()
        share = (counts / counts.sum().clamp_min(1)).tolist()
        probs = torch.cat(rec.probs) if rec.probs else torch.zeros(0, moe.n_experts)
        chosen = torch.cat(rec.chosen) if rec.chosen else torch.zeros(0, moe.top_k, dtype=torch.long)
        experts = []
        for e in range(moe.n_experts):
            mask = (chosen == e).any(dim=1)
            conf = float(probs[mask, e].mean()) if mask.any() else None
            toks = Counter(t for t, ex in pairs[i] if ex == e)
            n_e = sum(toks.values())
            top = [{"token": t, "text": decode(t), "share": c / n_e} for t, c in toks.most_common(top_tokens)]
            experts.append(
                {"expert": e, "share": share[e], "mean_prob": conf, "ordered_tokens": n_e, "top_tokens": top}
            )
        purity, used = token_purity(pairs[i], min_count)
        ent = -(probs * probs.clamp_min(1e-12).log()).sum(-1) if probs.numel() else torch.zeros(0)
        layers.append(
            {
                "layer": i,
                "experts": experts,
                "assignments": int(counts.sum()),
                "router_entropy": float(ent.mean()) if ent.numel() else None,
                "token_purity": purity,
                "tokens_for_purity": used,
                "largest_share": max(share) if share else None,
            }
        )
    return {
        "tool": "moe_specialization",
        "mode": "inference",
        "source": loaded.source,
        "data": data_desc,
        "device": str(dev),
        "routing": routing,
        "layers": layers,
    }


def _decoder(tokenizer: str | None, loaded):
    """token id → text with --tokenizer or the tokenizer.json of the run's data folder, else None."""
    from pathlib import Path

    path = tokenizer
    if path is None:
        ds = loaded.train_config.get("dataset")
        cand = Path(ds) if ds else None
        cand = cand if cand is None or cand.is_dir() else cand.parent
        if cand is not None and (cand / "tokenizer.json").is_file():
            path = str(cand / "tokenizer.json")
    if path is None:
        return lambda t: None
    from hydra_train.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    return lambda t: tok.decode([t])


def render_weight_balance(result: dict[str, Any], console) -> None:
    from hydra_diag.render import fmt, print_findings, rows_table

    for layer in result["layers"]:
        # fmt: a NaN imbalance reaches the renderer as None (the result is made JSON-able first)
        console.print(
            rows_table(
                f"layer {layer['layer']}: expert weight norms "
                f"(imbalance gate/up {fmt(layer['gate_up_imbalance'], '.2f')}x, "
                f"down {fmt(layer['down_imbalance'], '.2f')}x, "
                f"router {fmt(layer['router_imbalance'], '.2f')}x)",
                layer["experts"],
            )
        )
    print_findings(console, result["findings"], "weight-balance findings")


def render_specialization(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    if result["mode"] == "weights":
        console.print(
            rows_table(
                f"expert specialization from weights ({result['source']})",
                result["layers"],
                ["layer", "mean_expert_similarity", "mean_router_similarity"],
            )
        )
        return
    console.print(
        f"[bold]expert specialization[/] of {result['source']} on {result['data']} "
        f"({result['routing']} routing, {result['device']})",
        highlight=False,
    )
    for layer in result["layers"]:
        rows = [
            {
                **e,
                "top_tokens": ", ".join(
                    f"{t['text']!r}" if t["text"] is not None else str(t["token"]) for t in e["top_tokens"]
                ),
            }
            for e in layer["experts"]
        ]
        console.print(
            rows_table(
                f"layer {layer['layer']}: {layer['assignments']} assignments, "
                f"router entropy {layer['router_entropy']}, "
                f"token purity {layer['token_purity']} over {layer['tokens_for_purity']} tokens "
                f"(largest share {layer['largest_share']:.3f})",
                rows,
                ["expert", "share", "mean_prob", "ordered_tokens", "top_tokens"],
            )
        )
