"""``hydra-train tokenizer train``: a byte-level BPE for the user's own text.

The tokenizer is written as ``tokenizer.json`` beside the data by default (the folder given, or the
folder of the first file), which is where ``hydra-train run --dataset DATA`` looks for one, so the
usual sequence is two commands::

    hydra-train tokenizer train my_data/ --vocab_size 8192
    hydra-train run --dataset my_data/

With ``--out`` elsewhere, pass the same path to ``run --tokenizer``. No ``from __future__ import
annotations`` here: Typer reads these annotations at run time.
"""

from pathlib import Path
from typing import Annotated

import typer

from hydra_kernels.cli_support import console, emit_json, fail, new_app
from hydra_kernels.cli_support import opt as _opt

tokenizer_app = new_app("Build the tokenizer for your own text data.")

Files = Annotated[
    list[Path],
    typer.Argument(
        metavar="FILES",
        help="Text data: .txt, .jsonl, .parquet, .arrow files, folders of them, or a Hugging Face "
        "save_to_disk folder (its train split).",
        show_default=False,
    ),
]


def default_out(files: list[Path]) -> Path:
    """``tokenizer.json`` where ``run --dataset`` finds it: in the first folder given, else beside
    the first file."""
    first = files[0]
    return (first if first.is_dir() else first.parent) / "tokenizer.json"


def writable_folder(target: Path) -> None:
    """Create ``target``'s folder, and fail with one line naming it when a file cannot go there."""
    import os

    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        in_the_way = next((p for p in (folder, *folder.parents) if p.is_file()), None)
        why = f"{in_the_way} is a file, not a folder" if in_the_way else exc.strerror or str(exc)
        fail(f"cannot write {target}: its folder {folder} cannot be created ({why})")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"cannot write {target}: the folder {folder} is not writable")


@tokenizer_app.command("train")
def train(
    files: Files,
    vocab_size: Annotated[
        int,
        _opt(
            "--vocab_size",
            help="Vocabulary size, including the <|endoftext|> token (>= 300).",
            min=300,  # hydra_train.tokenizer.MIN_VOCAB: 256 byte symbols, the token, a few merges
        ),
    ] = 8192,
    out: Annotated[
        Path | None,
        _opt(
            "--out",
            help="Where to write tokenizer.json (default: in the data folder, where hydra-train run "
            "--dataset finds it; elsewhere, pass it to run --tokenizer).",
        ),
    ] = None,
    text_column: Annotated[
        str, _opt("--text_column", help="The text field of .jsonl lines and table columns.")
    ] = "text",
    force: Annotated[bool, _opt("--force", help="Replace an existing tokenizer file.")] = False,
    json_out: Annotated[bool, _opt("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Train a byte-level BPE tokenizer (Hugging Face tokenizers) on FILES and write tokenizer.json.
    Id 0 is <|endoftext|>, the end-of-document token training appends after every document."""
    from hydra_train.atomic_files import atomic_write_bytes
    from hydra_train.errors import HydraTrainError
    from hydra_train.text_tables import iter_texts
    from hydra_train.tokenizer import train_bpe

    target = out or default_out(files)
    if target.is_dir():
        target = target / "tokenizer.json"
    if target.exists() and not force:
        fail(f"{target} exists; pass --force to replace it (data tokenized with it would no longer match)")
    writable_folder(target)  # before training, which can take minutes on a large corpus
    counted = {"docs": 0, "chars": 0}

    def texts():
        for t in iter_texts(files, text_column):
            counted["docs"] += 1
            counted["chars"] += len(t)
            yield t

    try:
        tok = train_bpe(texts(), vocab_size)
    except HydraTrainError as exc:
        fail(str(exc))
    if counted["docs"] == 0:
        fail(f"no text found in {', '.join(map(str, files))}")
    try:
        atomic_write_bytes(target, tok.to_str().encode("utf-8"))
    except OSError as exc:  # e.g. the disk filled during training
        fail(f"could not write {target}: {exc.strerror or exc}")
    result = {
        "tokenizer": str(target),
        "vocab_size": tok.get_vocab_size(),
        "documents": counted["docs"],
        "characters": counted["chars"],
    }
    if json_out:
        return emit_json(result)
    console.print(
        f"wrote {target}: vocabulary {result['vocab_size']}, trained on {counted['docs']} documents "
        f"({counted['chars'] / 1e6:.2f}M characters)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    if out is not None and target != default_out(files):
        console.print(f"use it with: hydra-train run --tokenizer {target} ...", markup=False, soft_wrap=True)
