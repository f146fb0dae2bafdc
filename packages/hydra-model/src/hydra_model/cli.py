"""The `hydra-model` command line: sizes, info, generate, export-hf, import-hf (cli_hf.py)."""

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from hydra_kernels.cli_support import (
    AssignmentError,
    add_version_option,
    console,
    emit_json,
    err_console,
    fail,
    new_app,
    parse_assignments,
)
from hydra_model import __version__
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
    for col in (
        "preset",
        "params",
        "dim",
        "blocks×rec",
        "q/kv heads×d",
        "MLP",
        "GFLOP/tok (dense)",
        "memory",
    ):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for r in rows:
        table.add_row(
            r["model_size"],
            f"{r['parameters'] / 1e6:.1f}M",
            str(r["dim"]),
            f"{r['blocks']}×{r['recursions']}",
            f"{r['latent_q_heads']}/{r['latent_kv_heads']}×{r['head_dim']}",
            str(r["mlp_hidden"]),
            f"{r['flops_per_token_executed'] / 1e9:.2f} ({r['flops_per_token_dense'] / 1e9:.2f})",
            f"{r['estimated_training_gib']:.1f} GiB",
        )
    console.print(table)
    console.print(
        "FLOPs: training (fwd+bwd) per token, executed under routing; memory is an analytic estimate."
    )


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


def _find_tokenizer(checkpoint: Path, tokenizer: Path | None) -> Path:
    from hydra_model.text_generation import find_tokenizer

    try:
        return find_tokenizer(checkpoint, tokenizer)
    except FileNotFoundError as exc:
        fail(str(exc))


def _load_model(checkpoint: Path, device: str, allow_pickle: bool):
    """The model the checkpoint holds, as the architecture it records (HYDRA when none)."""
    from hydra_model.persistence import check_finite_weights, load_model

    if not checkpoint.exists():
        fail(f"--checkpoint {checkpoint} does not exist")
    try:
        model = load_model(checkpoint, map_location=device, allow_pickle=allow_pickle)
        check_finite_weights(model, checkpoint)
        return model
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(f"could not load {checkpoint}: {exc}")


@app.command()
def generate(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", help="save_pretrained directory or hydra-train .pt file.")
    ],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="tokenizers-library tokenizer.json (default: beside the checkpoint)."
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "--max_new_tokens", min=0)] = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = 0.0,
    top_k: Annotated[int | None, typer.Option("--top-k", "--top_k", min=1)] = None,
    top_p: Annotated[
        float | None,
        typer.Option("--top-p", "--top_p", min=0.0, max=1.0, help="Nucleus sampling: 0 < p ≤ 1."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    device: Annotated[
        str, typer.Option("--device", metavar="auto|cpu|cuda", help="cpu, cuda, or auto.")
    ] = "auto",
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", min=1, help="CPU threads (torch.set_num_threads; default: torch's choice)."
        ),
    ] = None,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle", "--allow_pickle", help="Trust a .pt checkpoint that holds pickled objects."
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (prompt, ids, text, tokens/s).")
    ] = False,
) -> None:
    """Continue --prompt with a trained model (greedy by default). Stops at the tokenizer's
    end-of-text token (<|endoftext|>) or after --max_new_tokens, and reports tokens/s on stderr."""
    import math
    import sys

    import torch

    from hydra_model import text_generation as tg

    if top_p is not None and top_p == 0:  # the option's range is closed; a nucleus of 0 is empty
        fail("--top-p must be > 0 (1 keeps every token)", code=2)
    if not math.isfinite(temperature):  # the option's minimum lets inf through
        fail(f"--temperature {temperature}: must be a finite number ≥ 0 (0 = greedy)", code=2)
    try:
        device = tg.resolve_device(device)
    except ValueError as exc:
        fail(str(exc), code=2)
    except RuntimeError as exc:
        fail(str(exc))
    if threads is not None:
        torch.set_num_threads(threads)

    if not checkpoint.exists():
        fail(f"--checkpoint {checkpoint} does not exist")
    tok_path = _find_tokenizer(checkpoint, tokenizer)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("the `tokenizers` package is needed to encode the prompt: pip install tokenizers")
    model = _load_model(checkpoint, device, allow_pickle)
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        fail(f"{tok_path} is not a readable tokenizer.json ({str(exc)[:120]}); pass one with --tokenizer")
    ids = tok.encode(prompt).ids
    if not ids:
        fail("the prompt encodes to no tokens; give some text", code=2)
    wrong_tokenizer = tg.prompt_ids_error(ids, model.config.vocab_size, tok_path, tokenizer is not None)
    if wrong_tokenizer:
        fail(wrong_tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    eos, eos_note = tg.usable_end_of_text(tok, model.config.vocab_size)
    with err_console.status("generating..."):
        result = tg.timed_generate(
            model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos,
            generator=gen,
            device=device,
        )
    text = tok.decode(result.ids)
    ignored = tg.ignored_sampling_note(temperature, top_k, top_p)  # said on stderr, not silently
    for note in filter(None, (ignored, eos_note, tg.undecodable_note(tok, result.ids, tok_path))):
        err_console.print(f"note: {note}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    if as_json:
        emit_json(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "generated_ids": result.ids,
                "text": text,
                "stopped_at_eos": result.stopped_at_eos,
                "eos_token_id": eos,
                "tokens": result.produced,
                "seconds": result.seconds,
                "tokens_per_s": result.tokens_per_s,
                "threads": torch.get_num_threads() if device == "cpu" else None,
            }
        )
    else:
        if console.is_terminal:  # soft_wrap: the terminal wraps it; no newlines are added
            console.print(Text(prompt, style="bold") + Text(text), highlight=False, soft_wrap=True)
        else:  # a pipe or file gets the text as it is (rich would wrap it and expand its tabs)
            sys.stdout.write(prompt + text + "\n")
        err_console.print(result.summary(), style="dim", highlight=False, markup=False)


register_hf_commands(app)  # export-hf, import-hf (cli_hf.py), listed after generate
