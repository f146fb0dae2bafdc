"""Token shard formats: reading (``.bin``, ``.pt``, ``.jsonl``, ``.txt``) and writing (``.bin``).

A shard is either a **stream** (a 1-D run of token ids; training cuts it into windows of
``seq_len + 1``) or **rows** (a 2-D ``[N, L]`` tensor; each row is one sequence of ``L`` tokens,
input ``row[:-1]``, target ``row[1:]``).

``.bin`` (a memory map; written by :func:`write_token_shard`)::

    offset  size  field
    0       8     magic  b"HYDRATOK"
    8       4     version (uint32, little-endian) = 1
    12      4     bytes per token (uint32): 2 for uint16, 4 for uint32
    16      8     number of tokens (uint64)
    24      8     largest token id in the shard (int64), -1 when unknown
    32      ...   the tokens, little-endian

    A headerless raw ``.bin`` (e.g. nanoGPT's uint16 files) is read when a JSON sidecar
    ``<file>.json`` sits beside it: ``{"dtype": "uint16"|"uint32", "header_bytes": 0}``.

``.pt`` (``torch.load(weights_only=True, mmap=True)``: memory-mapped, so a large shard does not
need RAM for its full size; a file in torch's legacy pre-zip format cannot be mapped and is read
whole, with a warning): a 1-D integer tensor (stream); or a dict with ``"tokens"`` (1-D, stream) or
``"input_ids"`` (2-D, rows).

``.jsonl`` (one ``{"text": ...}`` object per line), ``.txt`` (the whole file is one document) and
``.parquet`` / ``.arrow`` (one document per row of the text column; :mod:`hydra_train.text_tables`):
tokenized at load time with the dataset's tokenizer, every document followed by end-of-document.
The text field or column is ``--text_column`` (default ``text``). :func:`open_shards` packs each
run of neighbouring text files into one stream shard, so that files shorter than a window (one
sentence, a small source file) are used rather than left out.
"""

from __future__ import annotations

import json
import os
import shlex
import struct
import time
import warnings
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hydra_train.atomic_files import atomic_write_bytes
from hydra_train.errors import HydraDataError, short_error
from hydra_train.text_tables import TABLE_SUFFIXES, read_table_texts, unsupported_message
from hydra_train.tokenizer import encode_documents

MAGIC = b"HYDRATOK"
HEADER = struct.Struct("<8sIIQq")  # 32 bytes
SHARD_SUFFIXES = (".bin", ".pt", ".jsonl", ".txt", *TABLE_SUFFIXES)
TEXT_SUFFIXES = (".jsonl", ".txt", *TABLE_SUFFIXES)
#: characters of text gathered (over files) before they are encoded in one batched call
ENCODE_BATCH_CHARS = 8_000_000
#: seconds between progress lines while text is tokenized
PROGRESS_EVERY_S = 10.0


@dataclass
class Shard:
    """One opened shard: ``tokens`` is 1-D (stream) or 2-D (rows), numpy or memmap."""

    path: Path  # the file; for text files packed together (open_shards), their folder
    tokens: np.ndarray
    max_token_id: int | None  # None: not known without a scan (checked per batch instead)
    files: int = 1  # how many files the tokens come from

    @property
    def is_rows(self) -> bool:
        return self.tokens.ndim == 2

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


def write_token_shard(path: str | Path, tokens, max_token_id: int | None = None) -> Path:
    """Write a 1-D token sequence as a ``.bin`` shard (uint16 when ids fit, else uint32), atomically."""
    arr = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_token_shard wants a 1-D token sequence, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError("token ids must be >= 0")
    top = int(arr.max()) if arr.size else -1
    if max_token_id is not None and top > max_token_id:
        raise ValueError(f"token id {top} exceeds the declared max_token_id {max_token_id}")
    if top >= 2**32:  # the widest format is uint32: astype would wrap the id silently
        raise ValueError(f"token id {top} does not fit a .bin shard (at most {2**32 - 1})")
    width = 2 if top < 2**16 else 4
    body = arr.astype(np.uint16 if width == 2 else np.uint32).astype("<u" + str(width)).tobytes()
    header = HEADER.pack(MAGIC, 1, width, arr.size, top)
    p = Path(path)
    atomic_write_bytes(p, header + body)
    return p


class TokenShardWriter:
    """Write a ``.bin`` shard piece by piece (bounded memory): ``append`` 1-D id arrays, and on a
    clean exit the header gets the final count and largest id and the file is renamed into place
    (atomic like :func:`write_token_shard`: a crash leaves no partial shard under ``path``).
    ``width`` is the bytes per token, 2 (ids < 65536) or 4."""

    def __init__(self, path: str | Path, width: int):
        if width not in (2, 4):
            raise ValueError(f"width must be 2 or 4 bytes per token, got {width}")
        self.path, self.width = Path(path), width
        self.count, self.top = 0, -1
        self._dtype = np.dtype("<u" + str(width))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed in __exit__
        self._f.write(HEADER.pack(MAGIC, 1, width, 0, -1))

    def append(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        top = int(ids.max())
        if top >= 2 ** (8 * self.width) or int(ids.min()) < 0:
            raise ValueError(f"token id {top} does not fit {self.width} bytes per token")
        self.top = max(self.top, top)
        self._f.write(ids.astype(self._dtype, copy=False).tobytes())
        self.count += int(ids.size)

    def __enter__(self) -> TokenShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._f.seek(0)
                self._f.write(HEADER.pack(MAGIC, 1, self.width, self.count, self.top))
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)


def _open_bin(path: Path) -> Shard:
    sidecar = path.with_name(path.name + ".json")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if head[:8] == MAGIC:
        if len(head) < HEADER.size:
            raise HydraDataError(f"{path}: truncated header ({size} bytes)")
        _, version, width, n, top = HEADER.unpack(head)
        if version != 1 or width not in (2, 4):
            raise HydraDataError(f"{path}: unsupported .bin header (version {version}, {width} bytes/token)")
        if HEADER.size + n * width != size:
            raise HydraDataError(
                f"{path}: header says {n} tokens ({HEADER.size + n * width} bytes) but the file has "
                f"{size} bytes (truncated or corrupt shard)"
            )
        arr = (
            np.memmap(path, dtype=f"<u{width}", mode="r", offset=HEADER.size, shape=(n,))
            if n
            else (np.zeros(0, dtype=np.uint32))
        )
        return Shard(path, arr, None if top < 0 else int(top))
    if not sidecar.is_file():
        raise HydraDataError(
            f"{path}: not a HYDRA .bin shard (no {MAGIC.decode()} header) and no sidecar {sidecar.name} "
            'saying its layout, e.g. {"dtype": "uint16", "header_bytes": 0}'
        )
    try:
        meta = json.loads(sidecar.read_text())
        dtype = np.dtype(meta.get("dtype", "uint16")).newbyteorder("<")
        offset = int(meta.get("header_bytes", 0))
    except Exception as exc:
        raise HydraDataError(f"{sidecar}: unreadable sidecar ({short_error(exc)})") from None
    if dtype.kind != "u" or dtype.itemsize not in (2, 4):
        raise HydraDataError(f"{sidecar}: dtype must be uint16 or uint32, got {dtype}")
    if not 0 <= offset <= size:  # a sidecar meant for another file, or a shard since replaced
        raise HydraDataError(
            f"{path}: its sidecar {sidecar.name} says header_bytes {offset}, but the file has {size} bytes"
        )
    if (size - offset) % dtype.itemsize:
        raise HydraDataError(f"{path}: {size - offset} data bytes is not a whole number of {dtype} tokens")
    n = (size - offset) // dtype.itemsize
    arr = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, np.uint32)
    return Shard(path, arr, None)


def _from_tensor(path: Path, t: object) -> Shard:
    if isinstance(t, dict):
        if "tokens" in t:
            t = t["tokens"]
        elif "input_ids" in t:
            t = t["input_ids"]
            if not (isinstance(t, torch.Tensor) and t.ndim == 2):
                raise HydraDataError(f"{path}: 'input_ids' must be a 2-D tensor [rows, length]")
        else:
            raise HydraDataError(f"{path}: a dict shard needs a 'tokens' (1-D) or 'input_ids' (2-D) tensor")
    if not isinstance(t, torch.Tensor):
        raise HydraDataError(f"{path}: expected a token tensor or a dict of one, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise HydraDataError(f"{path}: token tensors must be integer, got {t.dtype}")
    if t.ndim not in (1, 2):
        raise HydraDataError(
            f"{path}: token tensor must be 1-D (stream) or 2-D (rows), got shape {tuple(t.shape)}"
        )
    arr = t.contiguous().numpy()
    if arr.size and int(arr.min()) < 0:
        raise HydraDataError(f"{path}: negative token id {int(arr.min())}")
    return Shard(path, arr, int(arr.max()) if arr.size else None)


def read_texts(path: Path, text_column: str = "text") -> list[str]:
    """The documents of one text file (``.txt``, ``.jsonl``, ``.parquet``, ``.arrow``)."""
    if path.suffix.lower() in TABLE_SUFFIXES:
        return read_table_texts(path, text_column)
    if path.suffix.lower() == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    texts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HydraDataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_column), str):
                raise HydraDataError(_jsonl_field_message(path, lineno, obj, text_column))
            texts.append(obj[text_column])
    return texts


def _jsonl_field_message(path: Path, lineno: int, obj: object, text_column: str) -> str:
    """Why a .jsonl line gives no text, and the --text_column that would read it: the line's first
    string-valued field when it has one (e.g. ``content``)."""
    where = f"{path}:{lineno}: each line must be an object with a {text_column!r} string"
    if not isinstance(obj, dict):
        return f"{where} (this line is a JSON {type(obj).__name__})"
    if text_column in obj:
        held = type(obj[text_column]).__name__
        return f"{where} (its {text_column!r} holds {held}); choose another --text_column"
    keys = ", ".join(map(str, obj)) or "none"
    texty = next((str(k) for k, v in obj.items() if isinstance(v, str)), None)
    fix = (
        f"pass --text_column {shlex.quote(texty)}"
        if texty
        else "pass --text_column <key> naming the text field"
    )
    return f"{where} (keys: {keys}); {fix}"


def _check_readable(p: Path) -> None:
    if not p.is_file():
        raise HydraDataError(f"{p}: no such file")
    if not os.access(p, os.R_OK):
        raise HydraDataError(f"{p}: not readable (permissions)")


def _load_pt(p: Path) -> object:
    # mmap keeps a large shard out of RAM (the pages are read on use, and are page cache the OS
    # can drop); only torch's zip format can be mapped, and the legacy format is rare, so it is
    # read whole and said so
    mappable = zipfile.is_zipfile(p)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=mappable)
    except Exception as exc:
        raise HydraDataError(f"{p}: unreadable .pt shard ({short_error(exc)})") from None
    if not mappable:
        warnings.warn(
            f"{p}: saved in torch's legacy (pre-zip) format, which cannot be memory-mapped; read whole "
            "into memory (torch.save it again to map it)",
            stacklevel=3,
        )
    return obj


def _needs_tokenizer(p: Path) -> HydraDataError:
    return HydraDataError(
        f"{p}: text data needs a tokenizer; pass --tokenizer path/to/tokenizer.json or put a "
        "tokenizer.json beside the data (hydra-train tokenizer train builds one)"
    )


def open_shard(path: str | Path, tokenizer=None, text_column: str = "text") -> Shard:
    """Open one shard by its suffix; every failure is a :class:`HydraDataError` naming the file."""
    p = Path(path)
    _check_readable(p)
    suffix = p.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _pack_text([p], tokenizer, text_column)
    try:
        if suffix == ".bin":
            return _open_bin(p)
        if suffix == ".pt":
            return _from_tensor(p, _load_pt(p))
    except HydraDataError:
        raise
    except (OSError, ValueError) as exc:
        raise HydraDataError(f"{p}: unreadable shard ({short_error(exc)})") from None
    raise HydraDataError(unsupported_message(p, [p]))


def _file_texts(p: Path, text_column: str) -> list[str]:
    _check_readable(p)
    try:
        return read_texts(p, text_column)
    except HydraDataError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise HydraDataError(f"{p}: unreadable shard ({short_error(exc)})") from None


def _pack_text(
    paths: list[Path], tokenizer, text_column: str, progress: Callable[[int, int], None] | None = None
) -> Shard:
    """One stream shard of the documents of ``paths`` in order, each followed by end-of-document
    (what encoding each file alone and joining the results gives). The texts of several files are
    encoded together, ``ENCODE_BATCH_CHARS`` at a time: one batched call runs on every core, where a
    call per small file would run on one. ``progress(files done, tokens)`` is called per batch."""
    if tokenizer is None:
        raise _needs_tokenizer(paths[0])
    parts: list[np.ndarray] = []
    docs: list[str] = []
    chars = n_tokens = 0

    def flush() -> None:
        nonlocal docs, chars, n_tokens
        if docs:
            ids = encode_documents(tokenizer, docs)
            # 2 bytes a token when the ids fit (a vocabulary up to 65536): joining the parts then
            # costs what the uint32 parts did alone; a part that does not fit makes the join uint32
            parts.append(ids.astype(np.uint16) if ids.size and int(ids.max()) < 2**16 else ids)
            n_tokens += int(ids.size)
        docs, chars = [], 0

    for i, p in enumerate(paths):
        for text in _file_texts(p, text_column):
            docs.append(text)
            chars += len(text)
            if chars >= ENCODE_BATCH_CHARS:  # also inside one large file: progress goes on
                flush()
                if progress is not None:
                    progress(i, n_tokens)
    flush()
    if progress is not None:
        progress(len(paths), n_tokens)
    arr = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    where = paths[0] if len(paths) == 1 else Path(os.path.commonpath(paths))
    return Shard(where, arr, int(arr.max()) if arr.size else None, files=len(paths))


def open_shards(
    paths: Iterable[str | Path],
    tokenizer=None,
    text_column: str = "text",
    log: Callable[[str], None] | None = None,
) -> list[Shard]:
    """Open ``paths`` in order; each run of neighbouring text files (``.txt``, ``.jsonl``, tables)
    becomes one stream shard (:func:`_pack_text`). Windows never cross a shard, so a text file
    shorter than a window would otherwise give no training data; packed, its documents follow the
    previous file's, separated by end-of-document, like the documents of one ``.jsonl`` file.
    ``log`` receives a progress line every ``PROGRESS_EVERY_S`` seconds while text is tokenized."""
    ps = [Path(p) for p in paths]
    n_text = sum(p.suffix.lower() in TEXT_SUFFIXES for p in ps)
    before = [0, 0]  # files and tokens of the groups done
    t0 = last = time.monotonic()

    def progress(done: int, tokens: int) -> None:
        nonlocal last
        now = time.monotonic()
        if log is not None and now - last >= PROGRESS_EVERY_S:
            last = now
            log(
                f"tokenizing text: {before[0] + done}/{n_text} files, "
                f"{(before[1] + tokens) / 1e6:.1f}M tokens, {now - t0:.0f} s"
            )

    out: list[Shard] = []
    group: list[Path] = []
    for p in [*ps, None]:
        if p is not None and p.suffix.lower() in TEXT_SUFFIXES:
            group.append(p)
            continue
        if group:
            out.append(_pack_text(group, tokenizer, text_column, progress))
            before[0] += len(group)
            before[1] += out[-1].num_tokens
            group = []
        if p is not None:
            out.append(open_shard(p))
    return out
