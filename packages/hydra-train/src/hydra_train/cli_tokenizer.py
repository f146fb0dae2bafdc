"""``hydra-train tokenizer train``: a byte-level BPE for the user's own text.

The tokenizer is written as ``tokenizer.json`` beside the data by default (the folder given, or the
folder of the first file), which is where ``hydra-train run --dataset DATA`` looks for one, so the
usual sequence is two commands::

    hydra-train tokenizer train my_data/ --vocab_size 8192
    hydra-train run --dataset my_data/

With ``--out`` elsewhere, pass the same path to ``run --tokenizer``. No ``from __future__ import
annotations`` here: Typer reads these annotations at run time.
"""

import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated

import typer

from hydra_kernels.cli_support import console, emit_json, fail, new_app, reflowed
from hydra_kernels.cli_support import opt as _opt

tokenizer_app = new_app("Build the tokenizer for your own text data.")

#: seconds between progress lines on stderr while the corpus is read (when it is not a terminal)
PROGRESS_EVERY_S = 10.0

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


def out_target(out: str | None, files: list[Path]) -> Path:
    """The tokenizer file that ``--out`` names. A trailing slash names a folder, created if need be
    (``Path`` drops the slash, which would turn ``newdir/`` into a file called ``newdir``)."""
    if out is None:
        return default_out(files)
    target = Path(out)
    if out.endswith(("/", os.sep)) or target.is_dir():
        return target / "tokenizer.json"
    return target


def stderr_is_terminal() -> bool:
    """Whether a person watches stderr (the tokenizers library's progress bars need a terminal)."""
    return sys.stderr.isatty()


def counted_with_progress(texts: Iterable[str], counted: dict[str, int], lines: bool) -> Iterator[str]:
    """``texts``, counting documents and characters into ``counted``; with ``lines``, a line on
    stderr every ``PROGRESS_EVERY_S`` seconds and one when the reading ends, if it took that long
    (stderr, so that ``--json`` on stdout stays parseable)."""
    t0 = last = time.monotonic()
    said = False

    def say(what: str) -> None:
        print(
            f"{what} {counted['docs']:,} documents, {counted['chars']:,} characters "
            f"({time.monotonic() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    for t in texts:
        counted["docs"] += 1
        counted["chars"] += len(t)
        yield t
        now = time.monotonic()
        if lines and now - last >= PROGRESS_EVERY_S:
            say("read")
            last, said = now, True
    if said:  # the merges come next and take a while on a large corpus: say why it is quiet
        say("learning the vocabulary from")


def writable_folder(target: Path) -> None:
    """Create ``target``'s folder, and fail with one line naming it when a file cannot go there."""
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
@reflowed
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
        str | None,  # not Path: it would drop a trailing slash, which means a folder
        _opt(
            "--out",
            help="Where to write tokenizer.json: a file, or a folder (one that exists, or a path "
            "ending in /) (default: in the data folder, where hydra-train run --dataset finds it; "
            "elsewhere, pass it to run --tokenizer).",
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
    from hydra_train.text_tables import iter_texts, text_sources
    from hydra_train.tokenizer import train_bpe

    try:  # the input first: "tokenizer.json exists" must not hide a mistyped data path
        text_sources(files)
    except HydraTrainError as exc:
        fail(str(exc))
    target = out_target(out, files)
    if target.exists() and not force:
        fail(f"{target} exists; pass --force to replace it (data tokenized with it would no longer match)")
    writable_folder(target)  # before training, which can take minutes on a large corpus
    counted = {"docs": 0, "chars": 0}
    # on a terminal the tokenizers library draws its own bars; lines of ours would break them
    bars = stderr_is_terminal()
    texts = counted_with_progress(iter_texts(files, text_column), counted, lines=not bars)
    try:
        tok = train_bpe(texts, vocab_size, show_progress=bars)
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
        hint = f"use it with: hydra-train run --tokenizer {target} ..."
        console.print(hint, highlight=False, markup=False, soft_wrap=True)
