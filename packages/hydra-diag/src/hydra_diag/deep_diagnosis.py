"""``analyze deep-diagnosis``: gradient flow and activations, layer by layer, in one training step.

One training-mode forward and backward (no optimizer step) on real or random batches. Recorded:

* activations: the RMS of the residual stream after the embedding and after every block, and of
  every block application's update (attention + FFN, before the router gate), recursion by recursion;
* gradients: the L2 norm of the gradient of each block's attention, FFN/experts, routers and norms
  (and of the embedding and final norm), with the weights' norm beside it.

Findings: a group whose gradient is exactly zero or far below the median (*dead*), one far above
it (*exploding*), a block application whose update is zero (*dead update*), a residual stream whose
RMS grows by a large factor through one block (*exploding activation*), and any NaN/Inf.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from hydra_diag.health import component_of
from hydra_diag.loading import autocast_for, batches_for, model_under_test, pick_device, require_hydra
from hydra_diag.output import Progress, no_progress


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class ActivationRecorder:
    """Forward hooks on the embedding, every block wrapper and every shared block (per call)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.active = True  # off during the backward (checkpoint recomputation fires hooks again)
        self.embed_rms: float | None = None
        self.block_out: dict[int, float] = {}
        self.updates: dict[int, list[float]] = {}
        self.nonfinite: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationRecorder:
        m = self.model
        self._handles.append(m.embed.register_forward_hook(self._embed))
        for i, blk in enumerate(m.blocks):
            self._handles.append(blk.register_forward_hook(self._block(i)))
            inner = blk.mor.block if hasattr(blk, "mor") else None
            if inner is not None:
                self._handles.append(inner.register_forward_hook(self._update(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _note(self, name: str, t: torch.Tensor) -> float:
        v = _rms(t)
        if not math.isfinite(v):
            self.nonfinite.append(name)
        return v

    def _embed(self, mod, args, out):
        if self.active:
            self.embed_rms = self._note("embedding", out)

    def _block(self, i: int):
        def hook(mod, args, out):
            t = _first_tensor(out)
            if self.active and t is not None:
                self.block_out[i] = self._note(f"block {i} output", t)

        return hook

    def _update(self, i: int):
        def hook(mod, args, out):
            t = _first_tensor(out)
            if self.active and t is not None:
                self.updates.setdefault(i, []).append(self._note(f"block {i} update", t))

        return hook


def gradient_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Gradient and weight norms per (block, component); parameters shared across recursions once."""
    groups: dict[tuple[str, str], dict[str, float]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        parts = name.split(".")
        where = (
            f"block {parts[1]}"
            if parts[0] == "blocks"
            else ("embedding" if parts[0] == "embed" else parts[0])
        )
        key = (where, component_of(name))
        g = groups.setdefault(key, {"grad_sq": 0.0, "weight_sq": 0.0, "params": 0, "missing": 0})
        g["weight_sq"] += float(p.detach().float().pow(2).sum())
        g["params"] += p.numel()
        if p.grad is None:
            g["missing"] += p.numel()
        else:
            g["grad_sq"] += float(p.grad.detach().float().pow(2).sum())
    rows = []
    for (where, comp), g in groups.items():
        gn, wn = math.sqrt(g["grad_sq"]), math.sqrt(g["weight_sq"])
        rows.append(
            {
                "where": where,
                "component": comp,
                "params": g["params"],
                "grad_norm": gn,
                "weight_norm": wn,
                "grad_to_weight": gn / wn if wn > 0 else None,
                "no_grad_params": g["missing"],
            }
        )
    return rows


def find_layer_problems(
    grads: list[dict[str, Any]],
    activations: dict[str, Any],
    dead_ratio: float = 1e-6,
    explode_ratio: float = 100.0,
    activation_growth: float = 50.0,
) -> list[dict[str, Any]]:
    """Dead/exploding gradient groups, dead updates, exploding activations, non-finite values."""
    findings = []

    def add(sev, kind, layer, msg):
        findings.append({"severity": sev, "kind": kind, "layer": layer, "message": msg})

    norms = [r["grad_norm"] for r in grads if math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0]
    median = statistics.median(norms) if norms else 0.0
    for r in grads:
        gn, label = r["grad_norm"], f"{r['where']} {r['component']}"
        if not math.isfinite(gn):
            add("error", "nonfinite_grad", r["where"], f"{label}: gradient norm is {gn}")
        elif r["no_grad_params"] == r["params"]:
            add("error", "no_grad", r["where"], f"{label}: no parameter received a gradient")
        elif median > 0 and gn <= dead_ratio * median:
            add("error", "dead_grad", r["where"], f"{label}: gradient norm {gn:.2e} vs median {median:.2e}")
        elif median > 0 and gn >= explode_ratio * median:
            add(
                "error",
                "exploding_grad",
                r["where"],
                f"{label}: gradient norm {gn:.2e} is {gn / median:.0f}x the median",
            )
    for name in activations.get("nonfinite", []):
        add("error", "nonfinite_activation", None, f"{name} holds NaN/Inf")
    for row in activations.get("blocks", []):
        for r, u in enumerate(row.get("update_rms") or []):
            if u == 0.0:
                add(
                    "error",
                    "dead_update",
                    f"block {row['block']}",
                    f"recursion {r}: the block's update is exactly zero",
                )
        growth = row.get("growth")
        if growth is not None and math.isfinite(growth) and growth > activation_growth:
            add(
                "warning",
                "exploding_activation",
                f"block {row['block']}",
                f"the residual stream's RMS grows {growth:.0f}x through this block",
            )
    return findings


def deep_diagnosis(
    model_size: str = "tiny",
    overrides: list[str] | dict[str, Any] | None = None,
    checkpoint: str | None = None,
    dataset: str | None = None,
    device: str = "auto",
    batch_size: int = 4,
    seq_len: int = 128,
    n_batches: int = 1,
    seed: int = 0,
    dead_ratio: float = 1e-6,
    explode_ratio: float = 100.0,
    model=None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Per-layer gradient and activation norms of one training step and the problems found.
    ``model``: diagnose this object instead of loading one (tests plant faults this way)."""
    torch.manual_seed(seed)
    dev = pick_device(device)
    progress("loading the model")
    loaded = model_under_test(model, model_size, overrides, checkpoint, dev)
    model, source, tc = loaded.model, loaded.source, loaded.train_config
    require_hydra(model, "deep diagnosis")  # hooks HYDRA's blocks and their recursions
    seq_len = min(seq_len, model.config.max_seq_len)
    batches, data_desc = batches_for(
        model,
        dataset=dataset,
        train_config=tc,
        batch_size=batch_size,
        seq_len=seq_len,
        n=n_batches,
        device=dev,
        seed=seed,
        split="train",
    )
    model.train()
    model.zero_grad(set_to_none=True)
    progress("forward and backward")
    losses = []
    with ActivationRecorder(model) as rec:
        for x, y in batches:
            rec.active = True
            with autocast_for(dev):
                out = model(x, targets=y)
            rec.active = False
            (out.loss / len(batches)).backward()
            losses.append(float(out.loss.detach()))
    grads = gradient_groups(model)
    blocks = []
    prev = rec.embed_rms
    for i in range(len(model.blocks)):
        out_rms = rec.block_out.get(i)
        blocks.append(
            {
                "block": i,
                "input_rms": prev,
                "output_rms": out_rms,
                "growth": out_rms / prev if prev and out_rms is not None else None,
                "update_rms": rec.updates.get(i, []),
            }
        )
        prev = out_rms
    activations = {"embedding_rms": rec.embed_rms, "blocks": blocks, "nonfinite": sorted(set(rec.nonfinite))}
    findings = find_layer_problems(grads, activations, dead_ratio, explode_ratio)
    model.zero_grad(set_to_none=True)
    return {
        "tool": "deep_diagnosis",
        "source": source,
        "data": data_desc,
        "device": str(dev),
        "loss": statistics.fmean(losses),
        "gradients": grads,
        "activations": activations,
        "findings": findings,
        "healthy": not any(f["severity"] == "error" for f in findings),
    }


def render_deep_diagnosis(result: dict[str, Any], console) -> None:
    from hydra_diag.render import fmt, print_findings, rows_table

    # fmt: a NaN loss reaches the renderer as None (the result is made JSON-able first)
    console.print(
        f"[bold]deep diagnosis[/] of {result['source']} on {result['data']} ({result['device']}), "
        f"loss {fmt(result['loss'], '.4f')}",
        highlight=False,
    )
    console.print(
        rows_table(
            "gradient norms per layer and component",
            result["gradients"],
            ["where", "component", "params", "grad_norm", "weight_norm", "grad_to_weight"],
        )
    )
    console.print(
        rows_table(
            "activation RMS through the residual stream",
            result["activations"]["blocks"],
            ["block", "input_rms", "output_rms", "growth", "update_rms"],
            formats={"update_rms": ".3g"},
        )
    )
    print_findings(console, result["findings"], "layer findings")
