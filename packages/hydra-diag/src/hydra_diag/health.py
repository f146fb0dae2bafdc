"""``health model``: is a HYDRA model sound before anyone trains it? (CPU-friendly.)

Checks, each with its measured value and what it is held to:

* parameter count: the distinct parameters (tied LM head once) equal the sum over unique tensors,
  and the preset itself lands within 10% of the seed table's count at vocab 32000;
* initialisation (fresh models): every Linear/Embedding/expert weight has std ≈ init_std, or
  init_std/√(2·blocks·recursions) for residual output projections (hydra-model's documented
  scheme); RMSNorm gains are 1 and Linear biases 0; no NaN/Inf anywhere (checkpoints too);
* a training forward/backward is finite and every trainable parameter receives a gradient;
* the initial loss (fresh models) is ≈ ln V: an untrained model should be uniform over the vocabulary;
* eval-mode causality: changing tokens after position t leaves the logits up to t unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hydra_diag.loading import LoadedModel, model_from_options, pick_device, random_batches
from hydra_diag.output import Progress, no_progress

#: Relative deviation of a weight's std from its documented init that still passes.
INIT_STD_TOLERANCE = 0.25
#: Tensors smaller than this give too noisy a std to judge.
INIT_MIN_NUMEL = 64
PRESET_COUNT_TOLERANCE = 0.10


def _check(name: str, passed: bool | None, value: Any, expected: Any, detail: str = "") -> dict[str, Any]:
    return {"name": name, "passed": passed, "value": value, "expected": expected, "detail": detail}


def component_of(param_name: str) -> str:
    """Coarse grouping of a parameter by its qualified name (for the breakdown table)."""
    parts = param_name.split(".")
    if parts[0] == "embed":
        return "embedding (tied LM head)"
    if "router" in parts:
        return "routers"
    if any("norm" in p for p in parts[:-1]) or parts[0] == "norm":
        return "norms"
    if "attn" in parts:
        return "attention"
    if "ffn" in parts:
        return "ffn / experts"
    return "other"


def parameter_breakdown(model: nn.Module) -> list[dict[str, Any]]:
    """Parameters per component (unique tensors), with their share of the total."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        seen.setdefault(id(p), (name, p))
    groups: dict[str, int] = {}
    for name, p in seen.values():
        groups[component_of(name)] = groups.get(component_of(name), 0) + p.numel()
    total = sum(groups.values()) or 1
    return [{"component": k, "params": v, "share": v / total} for k, v in sorted(groups.items())]


def preset_count_check(model_size: str) -> dict[str, Any]:
    """The preset at vocab 32000 (built on the meta device) against the seed table."""
    from hydra_model import SEED_PARAM_COUNTS, create_ccgqa_mod_mor_model

    if model_size not in SEED_PARAM_COUNTS:
        return _check(
            "preset params vs seed table", None, None, None, f"the seed table has no {model_size!r} row"
        )
    with torch.device("meta"):
        n = create_ccgqa_mod_mor_model(model_size, vocab_size=32000).num_parameters()
    want = SEED_PARAM_COUNTS[model_size]
    dev = n / want - 1
    return _check(
        "preset params vs seed table",
        abs(dev) <= PRESET_COUNT_TOLERANCE,
        f"{n / 1e6:.1f}M ({dev:+.1%})",
        f"{want / 1e6:.0f}M ± {PRESET_COUNT_TOLERANCE:.0%}",
        f"{model_size} at vocab 32000",
    )


def _owners(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for mod_name, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            out[f"{mod_name}.{pname}" if mod_name else pname] = mod
    return out


def init_statistics(model: nn.Module, fresh: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Per parameter: mean, std, finiteness and (fresh models) the documented init it should match.

    Returns (rows, problems)."""
    cfg = model.config
    std0 = cfg.init_std
    resid = std0 / math.sqrt(2 * cfg.effective_depth)
    owners = _owners(model)
    rows, problems = [], []
    for name, p in model.named_parameters():
        t = p.detach().float()
        finite = bool(torch.isfinite(t).all())
        row: dict[str, Any] = {
            "param": name,
            "shape": "x".join(map(str, p.shape)),
            "mean": float(t.mean()) if finite else None,
            "std": float(t.std()) if finite and t.numel() > 1 else None,
            "finite": finite,
            "expected": None,
            "ok": finite,
        }
        if not finite:
            problems.append(f"{name} holds NaN/Inf")
        owner = type(owners.get(name)).__name__
        leaf = name.rsplit(".", 1)[-1]
        if fresh and finite:
            expect = None
            if (owner in ("Linear", "Embedding") and leaf == "weight") or owner == "MoEFFN":
                if t.numel() >= INIT_MIN_NUMEL:
                    expect = "std"
            elif owner == "RMSNorm" and leaf == "weight":
                expect = "ones"
            elif owner == "Linear" and leaf == "bias":
                expect = "zeros"
            if expect == "std":
                std = row["std"]
                near = [s for s in (std0, resid) if abs(std / s - 1) <= INIT_STD_TOLERANCE]
                row["expected"] = f"{std0:.4g} or {resid:.4g}"
                row["ok"] = bool(near)
            elif expect == "ones":
                row["expected"] = "1"
                row["ok"] = bool((t == 1).all())
            elif expect == "zeros":
                row["expected"] = "0"
                row["ok"] = bool((t == 0).all())
            if expect and not row["ok"]:
                problems.append(
                    f"{name}: std {row['std']:.4g}, mean {row['mean']:.4g}; expected {row['expected']}"
                )
        rows.append(row)
    return rows, problems


def forward_backward_check(
    model: nn.Module, batch, device: torch.device
) -> tuple[list[dict[str, Any]], float]:
    """Training forward+backward on ``batch``: finite loss, finite gradients, none missing."""
    model.train()
    model.zero_grad(set_to_none=True)
    x, y = batch
    out = model(x, targets=y)
    loss_ok = bool(torch.isfinite(out.loss))
    out.loss.backward()
    missing, bad = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            missing.append(name)
        elif not torch.isfinite(p.grad).all():
            bad.append(name)
    model.zero_grad(set_to_none=True)
    ce = float(out.ce_loss.detach())
    checks = [
        _check("forward loss finite", loss_ok, float(out.loss.detach()), "finite"),
        _check(
            "gradients finite",
            not bad,
            f"{len(bad)} non-finite",
            "0",
            ", ".join(bad[:5]),
        ),
        _check(
            "every parameter gets a gradient",
            not missing,
            f"{len(missing)} without",
            "0",
            ", ".join(missing[:5]),
        ),
    ]
    return checks, ce


def logit_change(a: torch.Tensor, b: torch.Tensor, t: int) -> tuple[float, float]:
    """Largest |Δlogit| between two forwards [B, S, V] whose inputs differ only after position t:
    (at positions ≤ t, which a causal model leaves unchanged; after t)."""
    delta = (a.detach().float() - b.detach().float()).abs()
    return float(delta[:, : t + 1].max()), float(delta[:, t + 1 :].max())


@torch.no_grad()
def causality_check(
    model: nn.Module, vocab: int, seq_len: int, device: torch.device, seed: int
) -> dict[str, Any]:
    """Eval mode: logits at positions ≤ t must not change when tokens after t change."""
    model.eval()
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randint(0, vocab, (2, seq_len), generator=g)
    t = seq_len // 2
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randint(0, vocab, (2, seq_len - t - 1), generator=g)
    a = model(x.to(device)).logits.float()
    diff, after = logit_change(a, model(x2.to(device)).logits.float(), t)
    scale = float(a.abs().max()) or 1.0
    tol = 1e-4 * scale
    model.train()
    return _check(
        "eval causality",
        diff <= tol,
        f"max |Δlogit| before t: {diff:.2e}",
        f"≤ {tol:.1e}",
        f"t={t} of {seq_len}; positions after t changed by up to {after:.2e} (they should)",
    )


def model_health_check(
    model_size: str = "tiny",
    overrides: list[str] | dict[str, Any] | None = None,
    checkpoint: str | None = None,
    device: str = "cpu",
    batch_size: int = 2,
    seq_len: int = 64,
    seed: int = 0,
    loss_tolerance: float = 0.5,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Run every check on a fresh preset (or a checkpoint) and return the report."""
    torch.manual_seed(seed)
    dev = pick_device(device)
    progress("building the model")
    loaded: LoadedModel = model_from_options(model_size, overrides, checkpoint, dev)
    model, fresh = loaded.model, checkpoint is None
    cfg = model.config
    seq_len = min(seq_len, cfg.max_seq_len)
    checks = []
    n = model.num_parameters()
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    checks.append(_check("param count = unique tensors", n == unique, n, unique, "tied LM head counted once"))
    if fresh:
        checks.append(preset_count_check(model_size))
    progress("initialisation statistics")
    init_rows, init_problems = init_statistics(model, fresh)
    checks.append(
        _check(
            "initialisation" if fresh else "weights finite",
            not init_problems,
            f"{len(init_problems)} off",
            "hydra-model's documented init" if fresh else "no NaN/Inf",
            "; ".join(init_problems[:3]),
        )
    )
    progress("forward/backward")
    batch = random_batches(cfg.vocab_size, batch_size, seq_len, 1, seed, dev)[0]
    fb_checks, ce = forward_backward_check(model, batch, dev)
    checks += fb_checks
    ln_v = math.log(cfg.vocab_size)
    if fresh:
        checks.append(
            _check(
                "initial loss ≈ ln V",
                abs(ce - ln_v) <= loss_tolerance,
                round(ce, 4),
                f"{ln_v:.4f} ± {loss_tolerance}",
                "cross-entropy of the untrained model on random tokens",
            )
        )
    progress("eval causality")
    checks.append(causality_check(model, cfg.vocab_size, seq_len, dev, seed))
    return {
        "tool": "model_health_check",
        "model": {
            "source": loaded.source,
            "model_size": model_size if fresh else None,
            "params": n,
            "params_non_embedding": model.num_parameters(exclude_embeddings=True),
            "vocab_size": cfg.vocab_size,
            "dim": cfg.dim,
            # a dense GPT checkpoint has layers, neither recursions nor experts
            "blocks_x_recursions": (
                f"{cfg.n_mor_blocks}x{cfg.recursions_per_block}"
                if hasattr(cfg, "n_mor_blocks")
                else f"{cfg.n_layers} dense layers (GPT)"
            ),
            "moe": getattr(cfg, "moe_enabled", False),
            "device": str(dev),
            "initial_ce": ce,
            "ln_vocab": ln_v,
        },
        "checks": checks,
        "parameters": parameter_breakdown(model),
        "init_stats": init_rows,
        "passed": all(c["passed"] is not False for c in checks),
    }


def render_model_health(result: dict[str, Any], console) -> None:
    from hydra_diag.render import kv_table, print_checks, rows_table

    console.print(kv_table("model", result["model"]))
    console.print(rows_table("parameters by component", result["parameters"], formats={"share": ".1%"}))
    off = [r for r in result["init_stats"] if not r["ok"]]
    if off:
        console.print(rows_table("parameters off their documented init", off))
    print_checks(console, "health checks", result["checks"])
    verdict = "[green]all checks passed[/]" if result["passed"] else "[red]some checks failed[/]"
    console.print(verdict)
