"""Text out of tables: ``.parquet`` and ``.arrow`` files, and local Hugging Face datasets.

A table holds one document per row in its text column (``--text_column``, default ``text``).
``.parquet`` and ``.arrow`` are read with pyarrow (the ``hydra-train[parquet]`` extra); a folder
written by ``datasets``' ``save_to_disk`` (a ``Dataset``: ``state.json`` + ``dataset_info.json``;
a ``DatasetDict``: ``dataset_dict.json`` and one folder per split) is opened with
``datasets.load_from_disk`` (the ``hydra-train[datasets]`` extra). Neither package is imported
until such data is met, and a missing one is reported with the command that installs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hydra_train.errors import HydraDataError, short_error

TABLE_SUFFIXES = (".parquet", ".arrow")
#: What ``--dataset`` and ``hydra-train tokenizer train`` accept, for error messages.
SUPPORTED = (
    ".bin, .pt, .jsonl, .txt, .parquet, .arrow files (or folders of them), or a Hugging Face "
    "dataset folder written by save_to_disk"
)
#: What ``hydra-train tokenizer train`` reads: text only (.bin and .pt shards hold token ids).
TEXT_SUPPORTED = (
    ".txt, .jsonl, .parquet, .arrow files (or folders of them), or a Hugging Face dataset folder "
    "written by save_to_disk (.bin and .pt shards hold token ids, not text)"
)
#: Split names taken as validation data in a DatasetDict, in order of preference.
VAL_SPLITS = ("validation", "val", "valid")


def _install_hint(package: str, extra: str, what: str) -> HydraDataError:
    return HydraDataError(f"{what} needs the {package} package: pip install 'hydra-train[{extra}]'")


def _pyarrow(what: str):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise _install_hint("pyarrow", "parquet", what) from None
    return pyarrow


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise _install_hint("datasets", "datasets", what) from None
    return datasets


def _column_texts(table, column: str, where: str) -> list[str]:
    """The non-null strings of ``column``; errors name the columns present or the column's type."""
    pa = _pyarrow("reading tables")
    if column not in table.column_names:
        raise HydraDataError(
            f"{where}: no text column {column!r}; the columns are {', '.join(table.column_names)} "
            "(choose one with --text_column)"
        )
    col = table.column(column)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise HydraDataError(f"{where}: column {column!r} holds {col.type}, not text (--text_column)")
    return [t for t in col.to_pylist() if t is not None]


def read_table_texts(path: Path, column: str = "text") -> list[str]:
    """The documents of one ``.parquet`` or ``.arrow`` file (Arrow IPC, file or stream format)."""
    what = f"reading {path.name}"
    pa = _pyarrow(what)
    try:
        if path.suffix.lower() == ".parquet":
            pq = pa.parquet
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=[column] if column in names else None)
        else:
            try:
                table = pa.ipc.open_file(path).read_all()
            except pa.ArrowInvalid:  # save_to_disk writes the stream format
                table = pa.ipc.open_stream(path).read_all()
    except HydraDataError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise HydraDataError(f"{path}: unreadable {path.suffix} file ({short_error(exc)})") from None
    return _column_texts(table, column, str(path))


def is_hf_dataset_dir(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def read_hf_dataset(path: Path, column: str = "text") -> dict[str, list[str]]:
    """{split: documents} of a ``save_to_disk`` folder; a single ``Dataset`` is the split "train"."""
    datasets = _datasets(f"the Hugging Face dataset {path}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise HydraDataError(f"{path}: unreadable Hugging Face dataset ({short_error(exc)})") from None
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    out = {}
    for name, ds in splits.items():
        out[name] = _column_texts(ds.data.table, column, f"{path} (split {name})")
    return out


def hf_train_val(path: Path, column: str = "text") -> tuple[list[str], list[str] | None]:
    """(train documents, validation documents or None) of a ``save_to_disk`` folder."""
    splits = read_hf_dataset(path, column)
    if "train" not in splits:
        raise HydraDataError(f"{path}: the dataset has no 'train' split (splits: {', '.join(splits)})")
    val = next((splits[s] for s in VAL_SPLITS if s in splits), None)
    return splits["train"], val


def text_sources(paths: list[Path]) -> list[tuple[str, Path]]:
    """What :func:`iter_texts` reads, each as ``("hf", folder)`` or ``("file", path)``, in order;
    a path that does not exist or holds no text is refused here, before anything is read (so that
    ``hydra-train tokenizer train`` names a wrong input before it looks at its output). A folder is
    read as ``--dataset`` reads it, training part only (validation text must not shape the
    vocabulary): its ``train/`` subfolder when there is one, else its files in name order less
    those named like validation shards; a HF dataset's train split."""
    from hydra_train.data_sources import _VAL_NAME as VAL_NAME
    from hydra_train.data_sources import data_files

    out: list[tuple[str, Path]] = []
    for p in paths:
        if not p.exists():
            raise HydraDataError(f"{p}: no such file or folder")
        if is_hf_dataset_dir(p):
            out.append(("hf", p))
            continue
        if p.is_dir():
            folder = p / "train" if (p / "train").is_dir() else p
            files = [f for f in data_files(folder) if not VAL_NAME.search(f.stem)]  # as --dataset does
        else:
            files = [p]
        text_files = [f for f in files if f.suffix.lower() in (".txt", ".jsonl", *TABLE_SUFFIXES)]
        if not text_files:
            raise HydraDataError(unsupported_message(p, files, TEXT_SUPPORTED))
        out += [("file", f) for f in text_files]
    return out


def iter_texts(paths: list[Path], column: str = "text") -> Iterator[str]:
    """Every document of ``paths`` (files of any text format, folders of them, HF dataset folders,
    as :func:`text_sources` lists them), for training a tokenizer."""
    from hydra_train.shards import read_texts

    for kind, f in text_sources(paths):
        if kind == "hf":
            yield from hf_train_val(f, column)[0]
            continue
        try:
            texts = read_texts(f, column)
        except UnicodeDecodeError as exc:  # .jsonl is read strictly (.txt replaces bad bytes)
            raise HydraDataError(
                f"{f}: not UTF-8 text (it holds the byte {exc.object[exc.start]:#04x}, which UTF-8 "
                "does not allow there); re-encode the file as UTF-8"
            ) from None
        yield from texts


def unsupported_message(path: Path, files: list[Path], supported: str = SUPPORTED) -> str:
    """One line: what was found at ``path`` and what is ``supported`` (by ``--dataset``, by default)."""
    if path.is_file():
        found = f"unsupported data format {path.suffix or '(no suffix)'!r}"
    else:
        kinds = sorted({f.suffix.lower() or "(no suffix)" for f in files})
        found = f"no supported data files (found {', '.join(kinds)})" if kinds else "empty folder"
    return f"{path}: {found}; supported: {supported}"
