"""``hydra-model generate``: continue a prompt with a trained model (text_generation.py holds what
the command adds around :meth:`generate`; this is the command line around it).

The command's docstring is one line per paragraph: Typer's rich help keeps a line break inside a
paragraph, so a paragraph broken in the source renders ragged at 80 columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from hydra_kernels.cli_support import console, emit_json, err_console, fail
from hydra_model.error_text import shortened


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
    except (ValueError, RuntimeError, OSError) as exc:  # OSError: a file it may not read, too
        fail(f"could not load {checkpoint}: {exc}")


def _warn(message: str) -> None:
    """One warning line on stderr, before the generation (which may take a while)."""
    err_console.print(f"warning: {message}", style="yellow", highlight=False, markup=False, soft_wrap=True)


def generate_command(
    checkpoint: Annotated[
        Path,
        typer.Option(
            "--checkpoint", help="save_pretrained folder or hydra-train .pt file (its checksum is verified)."
        ),
    ],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="tokenizers-library tokenizer.json (default: the one beside the checkpoint)."
        ),
    ] = None,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens",
            "--max_new_tokens",
            min=0,
            help="Tokens to generate at most (fewer at end-of-text); past the model's max_seq_len, "
            "a warning.",
        ),
    ] = 64,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", min=0.0, help="Sampling temperature; 0 = greedy (the likeliest token)."
        ),
    ] = 0.0,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            "--top_k",
            min=1,
            help="Sample among the K likeliest tokens only (default: all; applies when --temperature > 0).",
        ),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            "--top-p",
            "--top_p",
            min=0.0,
            max=1.0,
            help="Nucleus sampling, 0 < p ≤ 1: the likeliest tokens whose probabilities add up to p "
            "(default: off; applies when --temperature > 0).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            metavar="auto|cpu|cuda",
            help="cpu, cuda, cuda:N, or auto (CUDA when a GPU is visible).",
        ),
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
    """Continue --prompt with a trained model (greedy by default).

    It stops at the tokenizer's end-of-text token (<|endoftext|>) or after --max-new-tokens.

    The speed (tokens/s) goes to stderr.

    Past the model's max_seq_len it still generates, with a warning: it was never trained on those positions.

    A --tokenizer smaller than the model's vocabulary is taken too, with a warning (ids past it have no text).
    """
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
        reason = shortened(str(exc), 120)
        fail(f"{tok_path} is not a readable tokenizer.json ({reason}); pass one with --tokenizer")
    ids = tok.encode(prompt).ids
    if not ids:
        fail("the prompt encodes to no tokens; give some text", code=2)
    vocab_size = model.config.vocab_size
    wrong_tokenizer = tg.prompt_ids_error(ids, vocab_size, tok_path, tokenizer is not None)
    if wrong_tokenizer:
        fail(wrong_tokenizer)
    # said before the generation, once: both run (see the two functions for why not refused)
    small = tg.small_tokenizer_warning(tok, vocab_size, tok_path) if tokenizer is not None else None
    too_long = tg.past_max_seq_len_warning(len(ids), max_new_tokens, model.config.max_seq_len)
    for warning in filter(None, (small, too_long)):
        _warn(warning)
    gen = torch.Generator(device=device).manual_seed(seed)
    eos, eos_note = tg.usable_end_of_text(tok, vocab_size)
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


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_command)
