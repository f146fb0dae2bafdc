"""``hydra-model export-hf`` and ``import-hf``: Hugging Face folders out and in (hf_export.py,
hf_import.py hold the logic; this is the command line around them).

The commands' docstrings are one line per paragraph: Typer's rich help keeps a line break inside
a paragraph, so a paragraph broken in the source renders ragged at 80 columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from hydra_kernels.cli_support import console, emit_json, fail, opt

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def export_hf_command(
    checkpoint: Annotated[
        Path, typer.Argument(help="save_pretrained folder or hydra-train .pt file (HYDRA or GPT).")
    ],
    out: Annotated[
        Path, typer.Argument(help="Folder to write (created; an earlier export there is replaced).")
    ],
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="tokenizer.json to ship (default: the one beside the checkpoint)."),
    ] = None,
    no_tokenizer: Annotated[
        bool, opt("--no_tokenizer", help="Write the model only, without a tokenizer.")
    ] = False,
    dtype: Annotated[
        str, typer.Option("--dtype", metavar="|".join(DTYPE_CHOICES), help="Dtype of the written weights.")
    ] = "float32",
    allow_pickle: Annotated[
        bool, opt("--allow_pickle", help="Trust a .pt checkpoint that holds pickled objects.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (files, model_type, ...).")] = False,
) -> None:
    """Write a checkpoint as a Hugging Face model folder.

    It holds model.safetensors, config.json (with a model_type), generation_config.json and the tokenizer.

    The dense GPT becomes a native Llama; HYDRA ships its modeling code (trust_remote_code=True).
    """
    from hydra_model.hf_export import export_hf
    from hydra_model.text_generation import find_tokenizer

    if dtype not in DTYPE_CHOICES:
        fail(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}", code=2)
    if no_tokenizer and tokenizer is not None:
        fail("--tokenizer and --no_tokenizer exclude each other", code=2)
    if not checkpoint.exists():
        fail(f"CHECKPOINT {checkpoint} does not exist")
    tok_path = None
    if not no_tokenizer:
        try:
            tok_path = find_tokenizer(checkpoint, tokenizer)
        except FileNotFoundError as exc:
            fail(f"{exc}; or pass --no_tokenizer to export the model alone")
    try:
        result = export_hf(checkpoint, out, tokenizer=tok_path, dtype=dtype, allow_pickle=allow_pickle)
    except (ValueError, RuntimeError, OSError) as exc:  # OSError: OUT unwritable (error_text.py)
        fail(f"could not export {checkpoint}: {exc}")
    if as_json:
        emit_json(result.to_dict())
        return
    remote = ", trust_remote_code=True" if result.model_type != "llama" else ""
    console.print(
        Text(f"wrote {out} ({result.arch} as model_type {result.model_type}, ")
        + Text(f"{result.parameters / 1e6:.2f}M parameters)")
    )
    console.print(Text("  " + ", ".join(result.files)), highlight=False)
    console.print(
        Text(f'  AutoModelForCausalLM.from_pretrained("{out}"{remote})'), highlight=False, soft_wrap=True
    )


def import_hf_command(
    hf_dir: Annotated[Path, typer.Argument(help="Hugging Face Llama folder (config.json + safetensors).")],
    out: Annotated[Path, typer.Argument(help="Checkpoint file to write (.pt).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (checkpoint, config, ...).")] = False,
) -> None:
    """Convert a Hugging Face Llama folder into a dense-GPT checkpoint.

    The checkpoint has hydra-train's layout (step 0); `hydra-model generate` loads it.

    The folder's tokenizer.json is copied beside it.

    Refused: what the GPT cannot compute exactly (biases, an untied LM head, scaled RoPE, other models).
    """
    from hydra_model.hf_import import import_hf

    try:
        result = import_hf(hf_dir, out)
    except (ValueError, OSError) as exc:  # OSError: OUT unwritable (error_text.py), or unreadable input
        fail(f"could not import {hf_dir}: {exc}")
    if as_json:
        emit_json(result)
        return
    cfg = result["config"]
    console.print(
        Text(
            f"wrote {out} (gpt: {cfg['n_layers']} layers × {cfg['dim']}, "
            f"{result['parameters'] / 1e6:.2f}M parameters)"
        ),
        highlight=False,
    )
    if result["tokenizer"]:
        console.print(Text(f"  tokenizer: {result['tokenizer']}"), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("export-hf")(export_hf_command)
    app.command("import-hf")(import_hf_command)
