"""The `hydra-model` command line: sizes, info, generate (cli_generate.py), export-hf, import-hf
(cli_hf.py)."""

from typing import Annotated, Any

import typer
from rich.table import Table

from hydra_kernels.cli_support import (
    AssignmentError,
    add_version_option,
    console,
    emit_json,
    fail,
    new_app,
    parse_assignments,
)
from hydra_model import __version__
from hydra_model.cli_generate import register as register_generate_command
from hydra_model.cli_hf import register as register_hf_commands

app = new_app(
    "The HYDRA model (CCGQA attention with MoD/MoR/MoE routing) and its dense GPT baseline: "
    "size presets, per-layer info, generation, Hugging Face export and import."
)
add_version_option(app, "hydra-model", __version__)

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config field, e.g. --set static_routing_mode=true (repeatable)."),
]


ArchOption = Annotated[
    str,
    typer.Option(
        "--arch", metavar="hydra|gpt", help="Architecture: hydra (routed) or gpt (the dense baseline)."
    ),
]


def _parse_overrides(items: list[str] | None) -> dict[str, Any]:
    try:
        return parse_assignments(items)
    except AssignmentError as exc:
        fail(f"--set {exc.item!r} is not FIELD=VALUE (e.g. --set mod_capacity=0.5)", code=2)


def _meta_model(model_size: str, overrides: dict[str, Any], arch: str = "hydra"):
    import torch

    from hydra_model.architectures import build_model

    try:
        with torch.device("meta"):  # shapes and counts only: nothing is allocated
            return build_model(arch, model_size, **overrides)
    except ValueError as exc:
        fail(str(exc), code=2)


def _shape_fields(model) -> dict[str, Any]:
    """Depth and attention widths of either architecture, under the same keys (a GPT layer is a
    block applied once; its heads are not latent, the keys keep HYDRA's names for scripts)."""
    cfg = model.config
    if hasattr(cfg, "n_layers"):
        blocks, recursions, hidden = cfg.n_layers, 1, cfg.mlp_hidden
    else:
        blocks, recursions, hidden = cfg.n_mor_blocks, cfg.recursions_per_block, cfg.mlp_hidden
    return {
        "dim": cfg.dim,
        "blocks": blocks,
        "recursions": recursions,
        "latent_q_heads": cfg.n_heads,
        "latent_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp_hidden": hidden,
        "vocab_size": cfg.vocab_size,
    }


@app.command()
def sizes(
    batch_size: Annotated[
        int, typer.Option("--batch-size", "--batch_size", min=1, help="Batch for the memory estimate.")
    ] = 8,
    seq_len: Annotated[
        int, typer.Option("--seq-len", "--seq_len", min=1, help="Sequence length for memory and FLOPs.")
    ] = 2048,
    overrides: SetOption = None,
    arch: ArchOption = "hydra",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Every size preset: parameters, width, blocks × recursions, heads, FLOPs, training memory."""
    from hydra_model.architectures import ARCHITECTURES, presets
    from hydra_model.footprint import compute_memory_footprint

    if arch not in ARCHITECTURES:
        fail(f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}", code=2)
    extra = _parse_overrides(overrides)
    rows = []
    for name in presets(arch):
        model = _meta_model(name, extra, arch)
        mem = compute_memory_footprint(model, batch_size, seq_len)
        rows.append(
            {
                "model_size": name,
                "parameters": model.num_parameters(),
                **_shape_fields(model),
                "flops_per_token_executed": model.flops_per_token(seq_len, executed=True),
                "flops_per_token_dense": model.flops_per_token(seq_len, executed=False),
                "estimated_training_gib": mem["estimated_training_mb"] / 1024,
            }
        )
    if as_json:
        emit_json(
            {"arch": arch, "batch_size": batch_size, "seq_len": seq_len, "overrides": extra, "presets": rows}
        )
        return
    table = Table(
        title=f"{arch} presets (training memory: B={batch_size}, T={seq_len}, AdamW, bf16 activations)"
    )
    # headers no wider than their cells, so that the eight columns fit 80 columns uncut; the
    # legend below says what the short ones mean
    depth = "layers" if arch == "gpt" else "blk×rec"
    for col in ("preset", "params", "dim", depth, "heads", "MLP", "GFLOP/tok", "memory"):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for r in rows:
        table.add_row(
            r["model_size"],
            f"{r['parameters'] / 1e6:.1f}M",
            str(r["dim"]),
            str(r["blocks"]) if arch == "gpt" else f"{r['blocks']}×{r['recursions']}",
            f"{r['latent_q_heads']}/{r['latent_kv_heads']}×{r['head_dim']}",
            str(r["mlp_hidden"]),
            f"{r['flops_per_token_executed'] / 1e9:.2f} ({r['flops_per_token_dense'] / 1e9:.2f})",
            f"{r['estimated_training_gib']:.1f} GiB",
        )
    console.print(table)
    if arch == "gpt":
        legend = (
            "heads: query/KV heads × head dim. GFLOP/tok: training (fwd+bwd) per token (dense in brackets: "
        )
        legend += "the same, nothing is routed). memory: an analytic estimate."
    else:
        legend = "blk×rec: MoR blocks × recursions of each. heads: latent query/KV heads × head dim. "
        legend += "GFLOP/tok: training (fwd+bwd) per token, executed under routing (dense in brackets). "
        legend += "memory: an analytic estimate."
    console.print(legend, highlight=False)


def _block_param_rows(model) -> list[dict[str, Any]]:
    rows = [{"name": "embedding (tied LM head)", "parameters": model.embed.weight.numel()}]
    for i, layer in enumerate(getattr(model, "layers", [])):  # the dense GPT
        attn = sum(p.numel() for p in layer.attn.parameters())
        ffn = sum(p.numel() for p in layer.mlp.parameters())
        total = sum(p.numel() for p in layer.parameters())
        rows.append(
            {
                "name": f"layer{i}",
                "parameters": total,
                "attention": attn,
                "ffn": ffn,
                "routers_norms": total - attn - ffn,
                "mod_routed": False,
            }
        )
    for i, blk in enumerate(getattr(model, "blocks", [])):
        attn = sum(p.numel() for p in blk.mor.block.attn.parameters())
        ffn = sum(p.numel() for p in blk.mor.block.ffn.parameters())
        total = sum(p.numel() for p in blk.parameters())
        rows.append(
            {
                "name": f"block{i}",
                "parameters": total,
                "attention": attn,
                "ffn": ffn,
                "routers_norms": total - attn - ffn,
                "mod_routed": bool(blk.routed),
            }
        )
    rows.append({"name": "final norm", "parameters": model.norm.weight.numel()})
    return rows


@app.command()
def info(
    model_size: Annotated[str, typer.Option("--model-size", "--model_size", help="Preset name.")] = "100M",
    seq_len: Annotated[
        int, typer.Option("--seq-len", "--seq_len", min=1, help="Sequence length for FLOPs.")
    ] = 2048,
    overrides: SetOption = None,
    arch: ArchOption = "hydra",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Layer by layer: parameters, and training FLOPs per token executed under routing vs dense."""
    from hydra_model.architectures import ARCHITECTURES
    from hydra_model.footprint import flops_breakdown

    if arch not in ARCHITECTURES:
        fail(f"--arch {arch!r}: choose one of {', '.join(ARCHITECTURES)}", code=2)
    extra = _parse_overrides(overrides)
    model = _meta_model(model_size, extra, arch)
    cfg = model.config
    params = _block_param_rows(model)
    executed = flops_breakdown(cfg, seq_len, executed=True)
    dense = {row["name"]: row["flops"] for row in flops_breakdown(cfg, seq_len, executed=False)}
    flops = [{**row, "dense_flops": dense[row["name"]]} for row in executed]
    summary = {
        "arch": arch,
        "model_size": model_size,
        "seq_len": seq_len,
        "config": cfg.to_dict(),
        "parameters": model.num_parameters(),
        "parameters_no_embedding": model.num_parameters(True),
        "flops_per_token_executed": sum(r["flops"] for r in flops),
        "flops_per_token_dense": sum(r["dense_flops"] for r in flops),
    }
    if as_json:
        emit_json({**summary, "parameter_rows": params, "flops_rows": flops})
        return
    pt = Table(title=f"{model_size}: parameters ({summary['parameters'] / 1e6:.2f}M)")
    for col in ("layer", "params", "attention", "ffn", "routers+norms", "MoD"):
        pt.add_column(col, justify="left" if col == "layer" else "right")
    for r in params:
        pt.add_row(
            r["name"],
            f"{r['parameters']:,}",
            f"{r['attention']:,}" if "attention" in r else "",
            f"{r['ffn']:,}" if "ffn" in r else "",
            f"{r['routers_norms']:,}" if "ffn" in r else "",
            ("routed" if r["mod_routed"] else "dense") if "mod_routed" in r else "",
        )
    console.print(pt)
    ft = Table(title=f"training FLOPs per token at T={seq_len} (fwd+bwd)")
    for col in ("application", "token share", "attn context", "MFLOP executed", "MFLOP dense"):
        ft.add_column(col, justify="left" if col == "application" else "right")
    for r in flops:
        ft.add_row(
            r["name"],
            f"{r['token_fraction']:.3f}",
            str(r["context"]),
            f"{r['flops'] / 1e6:.2f}",
            f"{r['dense_flops'] / 1e6:.2f}",
        )
    ft.add_row(
        "total",
        "",
        "",
        f"{summary['flops_per_token_executed'] / 1e6:.1f}",
        f"{summary['flops_per_token_dense'] / 1e6:.1f}",
        style="bold",
    )
    console.print(ft)


register_generate_command(app)  # cli_generate.py
register_hf_commands(app)  # export-hf, import-hf (cli_hf.py), listed after generate
