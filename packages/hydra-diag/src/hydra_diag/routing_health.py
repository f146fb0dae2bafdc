"""``health routing``: how a model's routers behave on real batches, and whether one collapsed.

For each batch the model runs in training mode and in eval mode (the same causal threshold rule
under causal routing, the default; top-k in training and a threshold in eval under expert choice),
without gradients; state that a training forward changes (loss-free MoE bias, statistics buffers)
is restored afterwards. Reported per layer:

* MoD: selected fraction (causal routing: the share taken, at most ⌈capacity·S⌉/S; expert choice:
  exactly that in training, the share whose router says yes in eval), capacity, router
  probability mean, and the spread of the router logits across tokens;
* MoR: average and expected depth, the depth histogram, and the histogram the capacity schedule
  implies (share reaching recursion r = c_r);
* MoE: expert utilisation, router entropy, KL to uniform, max violation.

:func:`detect_routing_problems` turns those numbers into findings (thresholds in
:class:`RoutingThresholds`): a router whose logits do not vary across tokens, eval routing that
selects (almost) every token or none, MoR depth piled into one bin, dead experts, an expert that
takes nearly every token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from hydra_diag.loading import batches_for, model_under_test, pick_device, require_hydra
from hydra_diag.output import Progress, no_progress
from hydra_diag.router_probe import RouterProbe, restore_buffers, snapshot_buffers


@dataclass(frozen=True)
class RoutingThresholds:
    logit_std_collapsed: float = 1e-3  # router scores identical across tokens
    select_all_or_none: float = 0.02  # eval selects ≤ this or ≥ 1 − this of the tokens
    eval_capacity_gap: float = 0.3  # |eval selected fraction − capacity| worth a warning
    saturated_share: float = 0.9  # share of σ(logit) outside (0.01, 0.99)
    depth_bin_collapsed: float = 0.98  # one MoR depth holding this share of tokens
    dead_expert_share: float = 0.1  # an expert below this fraction of its fair share 1/E
    collapsed_expert_share: float = 0.9  # one expert taking this share of the tokens
    imbalance_violation: float = 1.0  # max_e util_e·E − 1 above this: an expert has > 2× its share


def expected_depth_hist(capacities: list[float]) -> list[float]:
    """Share of tokens at depth 0..R when recursion r admits a share c_r of the tokens (c_R = 0)."""
    if not capacities:
        return []
    caps = [*capacities, 0.0]
    # depth d means recursions 0..d−1 ran: P(d) = c_{d−1} − c_d, with c_{−1} = 1 and c_R = 0
    return [(1.0 if d == 0 else caps[d - 1]) - caps[d] for d in range(len(capacities) + 1)]


def _mean_rows(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if not vals:
            continue
        if isinstance(vals[0], list):
            out[k] = [sum(v[i] for v in vals) / len(vals) for i in range(len(vals[0]))]
        else:
            out[k] = sum(vals) / len(vals)
    return out


@torch.no_grad()
def collect_routing(model: torch.nn.Module, batches: list, mode: str) -> dict[str, Any]:
    """Forward every batch in ``mode`` (train|eval) and average the routing statistics per layer."""
    from hydra_model import routing_stats_to_python

    was_training = model.training
    model.train(mode == "train")
    saved = snapshot_buffers(model)
    per: dict[str, dict[int, list[dict[str, Any]]]] = {"mod": {}, "mor": {}, "moe": {}}
    probe_gap = 0.0
    tokens = batches[0][0].numel()
    try:
        with RouterProbe(model, batch_tokens=tokens) as probe:
            for x, _ in batches:
                before = {i: len(c.chosen) for i, c in probe.moe.items()}
                model(x)
                stats = routing_stats_to_python(model.routing_stats())
                for kind in per:
                    for row in stats.get(kind, []):
                        per[kind].setdefault(int(row["layer"]), []).append(row)
                for row in stats.get("moe", []):
                    rec = probe.moe[int(row["layer"])]
                    counts = torch.zeros(rec.n_experts)
                    for c in rec.chosen[before[int(row["layer"])] :]:
                        counts += torch.bincount(c.reshape(-1), minlength=rec.n_experts).float()
                    share = counts / counts.sum().clamp_min(1)
                    gap = (share - torch.tensor(row["utilization"])).abs().max()
                    probe_gap = max(probe_gap, float(gap))
                if mode == "train":
                    restore_buffers(model, saved)
    finally:
        restore_buffers(model, saved)
        model.train(was_training)
    out: dict[str, Any] = {"mod": [], "mor": [], "moe": [], "probe_vs_model_max_diff": probe_gap}
    for layer, rows in sorted(per["mod"].items()):
        keys = ("selected_frac", "capacity", "router_prob_mean", "passed_frac")
        row = {"layer": layer, **_mean_rows(rows, keys)}
        row.update(probe.mod.get(layer).summary() if layer in probe.mod else {})
        out["mod"].append(row)
    for layer, rows in sorted(per["mor"].items()):
        row = {"layer": layer, **_mean_rows(rows, ("avg_depth", "expected_depth", "depth_hist"))}
        row.update(
            {f"r0_{k}": v for k, v in probe.mor[layer].summary().items()} if layer in probe.mor else {}
        )
        out["mor"].append(row)
    for layer, rows in sorted(per["moe"].items()):
        row = {
            "layer": layer,
            **_mean_rows(rows, ("entropy", "utilization", "kl_to_uniform", "max_violation")),
        }
        rec = probe.moe.get(layer)
        if rec is not None:
            row["top_k"] = rec.top_k
            counts = rec.counts()
            row["assignments"] = int(counts.sum())
        out["moe"].append(row)
    return out


def detect_routing_problems(
    report: dict[str, Any], capacities: dict[str, Any], th: RoutingThresholds = RoutingThresholds()
) -> list[dict[str, Any]]:
    """Findings from :func:`collect_routing` results of both modes (``report["train"|"eval"]``)."""
    findings: list[dict[str, Any]] = []

    def add(sev: str, kind: str, layer: int | None, msg: str) -> None:
        findings.append({"severity": sev, "kind": kind, "layer": layer, "message": msg})

    cap = capacities.get("mod_capacity")
    for mode in ("train", "eval"):
        for row in report.get(mode, {}).get("mod", []):
            std = row.get("logit_std")
            if std is not None and std < th.logit_std_collapsed:
                add(
                    "error",
                    "mod_router_collapsed",
                    row["layer"],
                    f"{mode}: MoD router logits do not vary across tokens (std {std:.2e}); "
                    "top-k is arbitrary",
                )
            sat = row.get("frac_saturated")
            if sat is not None and sat > th.saturated_share:
                add(
                    "warning",
                    "mod_router_saturated",
                    row["layer"],
                    f"{mode}: {sat:.0%} of MoD router probabilities are below 0.01 or above 0.99",
                )
    for row in report.get("eval", {}).get("mod", []):
        # causal routing: the share that cleared the router's threshold (what is taken is also
        # capped by the budget, so a router that says yes to everything still takes c)
        frac = row.get("passed_frac", row.get("selected_frac"))
        if frac is None or cap is None:
            continue
        if cap < 1 - th.select_all_or_none and (
            frac <= th.select_all_or_none or frac >= 1 - th.select_all_or_none
        ):
            add(
                "error",
                "mod_selects_all_or_none",
                row["layer"],
                f"eval routing selects {frac:.1%} of tokens with capacity {cap:.0%}: the router collapsed",
            )
        elif abs(frac - cap) > th.eval_capacity_gap:
            add(
                "warning",
                "mod_eval_capacity_gap",
                row["layer"],
                f"eval routing selects {frac:.1%} of tokens, training capacity is {cap:.0%}",
            )
    want = expected_depth_hist(list(capacities.get("mor_capacities") or []))
    for row in report.get("eval", {}).get("mor", []):
        hist = row.get("depth_hist") or []
        if hist and max(hist) >= th.depth_bin_collapsed and max(want or [1.0]) < th.depth_bin_collapsed:
            depth = hist.index(max(hist))
            add(
                "error",
                "mor_depth_collapsed",
                row["layer"],
                f"eval: {max(hist):.0%} of tokens stop at depth {depth}; the capacity schedule spreads them "
                f"as {[round(w, 2) for w in want]}",
            )
    for mode in ("train", "eval"):
        for row in report.get(mode, {}).get("moe", []):
            util = row.get("utilization") or []
            n = len(util)
            if not n:
                continue
            k = int(row.get("top_k", 1))
            top = max(util)
            if top * k >= th.collapsed_expert_share and n > k:
                add(
                    "error",
                    "moe_collapsed",
                    row["layer"],
                    f"{mode}: expert {util.index(top)} takes {top * k:.0%} of the tokens",
                )
            dead = [e for e, u in enumerate(util) if u < th.dead_expert_share / n]
            if dead:
                add(
                    "error",
                    "moe_dead_experts",
                    row["layer"],
                    f"{mode}: experts {dead} get < {th.dead_expert_share:.0%} of their fair share 1/{n}",
                )
            viol = row.get("max_violation")
            if viol is not None and viol > th.imbalance_violation and top * k < th.collapsed_expert_share:
                add(
                    "warning",
                    "moe_imbalance",
                    row["layer"],
                    f"{mode}: max violation {viol:.2f} (an expert gets {viol + 1:.1f}× its fair share)",
                )
    gap = max(report.get(m, {}).get("probe_vs_model_max_diff", 0.0) for m in ("train", "eval"))
    if gap > 1e-4:
        add(
            "warning",
            "probe_mismatch",
            None,
            f"the MoE expert choices recomputed from the router differ from the model's own utilisation by "
            f"{gap:.3g}: hydra-model's selection rule changed, token-level MoE numbers are unreliable",
        )
    return findings


def routing_health(
    model_size: str = "tiny",
    overrides: list[str] | dict[str, Any] | None = None,
    checkpoint: str | None = None,
    dataset: str | None = None,
    device: str = "auto",
    batch_size: int = 4,
    seq_len: int = 128,
    n_batches: int = 2,
    seed: int = 0,
    thresholds: RoutingThresholds = RoutingThresholds(),
    model=None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Routing statistics in train and eval mode and the problems found (see the module docstring).
    ``model``: probe this model object instead of loading one (tests plant faults this way)."""
    torch.manual_seed(seed)
    dev = pick_device(device)
    progress("loading the model")
    loaded = model_under_test(model, model_size, overrides, checkpoint, dev)
    model, source, train_cfg = loaded.model, loaded.source, loaded.train_config
    require_hydra(model, "health routing")
    cfg = model.config
    seq_len = min(seq_len, cfg.max_seq_len)
    progress("reading batches")
    batches, data_desc = batches_for(
        model,
        dataset=dataset,
        train_config=train_cfg,
        batch_size=batch_size,
        seq_len=seq_len,
        n=n_batches,
        device=dev,
        seed=seed,
    )
    report: dict[str, Any] = {}
    for mode in ("train", "eval"):
        progress(f"{mode}-mode forwards")
        report[mode] = collect_routing(model, batches, mode)
    caps = {"mod_capacity": cfg.mod_capacity, "mor_capacities": list(cfg.mor_capacity_schedule)}
    findings = detect_routing_problems(report, caps, thresholds)
    return {
        "tool": "routing_healthcheck",
        "source": source,
        "data": data_desc,
        "device": str(dev),
        "config": {
            **caps,
            "static_routing_mode": cfg.static_routing_mode,
            "routing_off": cfg.routing_off,
            "mor_routing": cfg.mor_routing,
            "moe_enabled": cfg.moe_enabled,
            "moe_num_experts": cfg.moe_num_experts if cfg.moe_enabled else None,
        },
        "expected_depth_hist": expected_depth_hist(caps["mor_capacities"]),
        "train": report["train"],
        "eval": report["eval"],
        "findings": findings,
        "thresholds": asdict(thresholds),
        "healthy": not any(f["severity"] == "error" for f in findings),
    }


def render_routing_health(result: dict[str, Any], console) -> None:
    from hydra_diag.render import kv_table, print_findings, rows_table

    console.print(
        kv_table("routing health", {"source": result["source"], "data": result["data"], **result["config"]})
    )
    for mode in ("train", "eval"):
        r = result[mode]
        if r["mod"]:
            console.print(
                rows_table(
                    f"MoD ({mode} mode)",
                    r["mod"],
                    [
                        "layer",
                        "selected_frac",
                        "capacity",
                        "router_prob_mean",
                        "logit_std",
                        "frac_above_half",
                        "frac_saturated",
                    ],
                )
            )
        if r["mor"]:
            console.print(
                rows_table(
                    f"MoR ({mode} mode); schedule implies depth shares "
                    f"{[round(v, 3) for v in result['expected_depth_hist']]}",
                    r["mor"],
                    ["layer", "avg_depth", "expected_depth", "depth_hist", "r0_logit_std"],
                    formats={"depth_hist": ".3f"},
                )
            )
        if r["moe"]:
            console.print(
                rows_table(
                    f"MoE ({mode} mode)",
                    r["moe"],
                    ["layer", "utilization", "entropy", "kl_to_uniform", "max_violation", "assignments"],
                    formats={"utilization": ".3f"},
                )
            )
    print_findings(console, result["findings"], "routing findings")
