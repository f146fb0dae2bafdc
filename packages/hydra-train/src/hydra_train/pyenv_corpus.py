"""The ``pyenv`` corpus: the source files of the running Python environment, large enough to race on.

Which files: every file ending in one of ``extensions`` (default ``.py``) under the interpreter's
standard library (sysconfig ``stdlib``/``platstdlib``) and its installed packages (sysconfig
``purelib``/``platlib`` and ``site.getsitepackages()``). Roots are deduplicated by real path; a
walk never descends into a folder that is another root (a venv's ``lib/python3.X`` holds its
``site-packages``), so each file belongs to one root. A file's *key* is ``stdlib/<relative path>``
or ``site/<relative path>``; when two roots hold the same key (a package installed both in a venv
and in the base interpreter) the first root wins, as it would on ``sys.path``. ``__pycache__``
folders, files over :data:`MAX_FILE_BYTES` (generated tables, not source) and files with NUL bytes
(binary) are left out.

Split and order: the split is :func:`hydra_train.corpus.is_validation_path` of the key (the first
byte of its sha1), so it depends only on the key; within each split the files follow the sha1 of
their key, which spreads packages evenly through the token stream (a prefix of the training split,
the tokenizer's sample, is then a fair sample of every package rather than the first letters).

Cache: ``<cache>/corpora/pyenv-<key>/`` holds ``tokenizer.json``, ``train.bin``, ``val.bin``
(hydra-train ``.bin`` shards, uint16 for a 32K vocabulary, memory-mapped on read) and
``meta.json`` (sizes; written last, so its presence means the folder is complete). The cache key
hashes the *manifest*, every (key, size in bytes, mtime in ns), plus the extensions, the
vocabulary size, the tokenizer sample size and :data:`FORMAT_VERSION`. Listing and ``stat`` of
~100K files takes a second or two; hashing their contents would read a GB on every run. The one
change this misses is a file rewritten with the same size and mtime, which package managers do not
do (they write new files).

Duplicates: a file whose bytes equal an earlier file's (the same header shipped by two packages, a
vendored copy) is tokenized once: the training split first, then validation, so no validation
file repeats a training file and no training text is seen twice per epoch. They are counted
(``duplicates`` in meta.json and the description).

Tokenizing streams: files are read and encoded in batches of about :data:`BATCH_CHARS` characters
(``encode_batch_fast`` runs each batch on every core, in Rust), and the ids are appended to the
shard on disk, so memory stays bounded by one batch whatever the size of the environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra_train.atomic_files import atomic_write_bytes
from hydra_train.corpus import is_validation_path
from hydra_train.errors import HydraDataError
from hydra_train.shards import TokenShardWriter
from hydra_train.tokenizer import encode_documents, load_tokenizer, train_bpe

#: 2: identical files tokenized once; 3: "<|endoftext|>" inside a file is text (encode_documents),
#: so the shards of a version-2 cache, which ended a document there, are built again
FORMAT_VERSION = 3
DEFAULT_EXTENSIONS = ("py",)
MAX_FILE_BYTES = 4_000_000
BATCH_CHARS = 16_000_000
#: characters of the training split (in key-hash order) the BPE is trained on
TOKENIZER_SAMPLE_CHARS = 24_000_000
_SKIP_DIRS = {"__pycache__"}
_SITE_DIRS = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class SourceFile:
    key: str  # "stdlib/json/decoder.py", "site/numpy/core/numeric.py"
    path: str
    size: int
    mtime_ns: int


@dataclass
class PyenvCorpus:
    """A built (or cached) corpus: where its shards and tokenizer are, and how big it is."""

    folder: Path
    cache_key: str
    roots: list[str]
    extensions: list[str]
    files: dict[str, int]  # split -> number of files
    bytes: dict[str, int]  # split -> bytes of source
    tokens: dict[str, int]  # split -> tokens (end-of-document ids included)
    by_extension: dict[str, int]  # extension -> number of files found (before unreadable ones are dropped)
    vocab_size: int
    cache_hit: bool
    build_s: float
    #: split -> files left out because their bytes equal an earlier file's
    duplicates: dict[str, int] = field(default_factory=dict)

    @property
    def train_path(self) -> Path:
        return self.folder / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.folder / "val.bin"

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / "tokenizer.json"

    def describe(self) -> str:
        n_files = sum(self.files.values())
        mb = sum(self.bytes.values()) / 1e6
        tok = sum(self.tokens.values()) / 1e6
        exts = ",".join(self.extensions)
        return (
            f"pyenv ({exts}): {n_files} files, {mb:.1f} MB, {tok:.1f}M tokens "
            f"(train {self.tokens['train'] / 1e6:.1f}M in {self.files['train']} files, "
            f"val {self.tokens['val'] / 1e6:.2f}M in {self.files['val']} files), vocab {self.vocab_size}"
            + (
                f", {sum(self.duplicates.values())} duplicate files left out"
                if any(self.duplicates.values())
                else ""
            )
            + (" [cached]" if self.cache_hit else f" [built in {self.build_s:.0f} s]")
        )

    def summary(self) -> dict:
        """The JSON-able description (paths as strings)."""
        out = asdict(self)
        out["folder"] = str(self.folder)
        return out


def parse_extensions(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"py,pyi,.c"`` → ``("c", "py", "pyi")``: sorted, deduplicated, without dots."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or DEFAULT_EXTENSIONS)
    exts = sorted({e.strip().lstrip(".").lower() for e in items if e.strip()})
    bad = [e for e in exts if not e.replace("_", "").isalnum()]
    if not exts or bad:
        raise HydraDataError(f"--extensions {spec!r}: give file extensions such as py,pyi,c,md")
    return tuple(exts)


def environment_roots() -> list[tuple[str, Path]]:
    """(label, folder) of the interpreter's library and package folders, real paths, deduplicated."""
    paths = sysconfig.get_paths()
    cands = [("stdlib", paths.get("stdlib")), ("stdlib", paths.get("platstdlib"))]
    cands += [("site", paths.get("purelib")), ("site", paths.get("platlib"))]
    getsitepackages = getattr(site, "getsitepackages", None)  # absent from some embedded interpreters
    if getsitepackages is not None:
        cands += [("site", p) for p in getsitepackages()]
    return dedupe_roots([(label, Path(p)) for label, p in cands if p])


def dedupe_roots(roots: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    out, seen = [], set()
    for label, p in roots:
        if not p.is_dir():
            continue
        real = Path(os.path.realpath(p))
        if real not in seen:
            seen.add(real)
            out.append((label, real))
    return out


def scan_sources(roots: list[tuple[str, Path]], extensions: tuple[str, ...]) -> list[SourceFile]:
    """Every wanted file under ``roots`` (see the module docstring), sorted by key."""
    suffixes = tuple("." + e for e in extensions)
    root_reals = {str(r) for _, r in roots}
    by_key: dict[str, SourceFile] = {}
    seen_real: set[str] = set()
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            keep = []
            for d in sorted(dirnames):
                sub = here / d
                if d in _SKIP_DIRS or os.path.realpath(sub) in root_reals:
                    continue
                if label == "stdlib" and d in _SITE_DIRS:
                    continue  # packages are the site roots' business
                keep.append(d)
            dirnames[:] = keep
            for fn in filenames:
                if not fn.lower().endswith(suffixes):
                    continue
                p = here / fn
                try:
                    st = p.stat()
                except OSError:
                    continue  # a dangling link or unreadable entry is not part of the corpus
                real = os.path.realpath(p)
                if st.st_size > MAX_FILE_BYTES or real in seen_real:
                    continue
                key = f"{label}/{p.relative_to(root).as_posix()}"
                if key in by_key:
                    continue
                seen_real.add(real)
                by_key[key] = SourceFile(key, str(p), int(st.st_size), int(st.st_mtime_ns))
    return [by_key[k] for k in sorted(by_key)]


def cache_key(
    files: list[SourceFile], extensions: tuple[str, ...], vocab_size: int, sample_chars: int
) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{','.join(extensions)}|{vocab_size}|{sample_chars}|".encode())
    for f in files:
        h.update(f"{f.key}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _hash_order(files: list[SourceFile]) -> list[SourceFile]:
    return sorted(files, key=lambda f: hashlib.sha1(f.key.encode("utf-8")).digest())


def split_sources(files: list[SourceFile]) -> dict[str, list[SourceFile]]:
    """{"train": [...], "val": [...]} in key-hash order (see the module docstring)."""
    ordered = _hash_order(files)
    return {
        "train": [f for f in ordered if not is_validation_path(f.key)],
        "val": [f for f in ordered if is_validation_path(f.key)],
    }


class ContentSeen:
    """Digests of the file contents read so far, and how many copies were met (left out)."""

    def __init__(self) -> None:
        self.digests: set[bytes] = set()
        self.copies = 0

    def is_copy(self, data: bytes) -> bool:
        digest = hashlib.sha1(data).digest()
        if digest in self.digests:
            self.copies += 1
            return True
        self.digests.add(digest)
        return False


def read_text(f: SourceFile, seen: ContentSeen | None = None) -> str | None:
    """The file as text (undecodable bytes replaced), or None when it is unreadable, binary or
    (with ``seen``) a copy of a file read before."""
    try:
        data = Path(f.path).read_bytes()
    except OSError:
        return None
    if b"\0" in data or (seen is not None and seen.is_copy(data)):
        return None
    return data.decode("utf-8", errors="replace")


def text_batches(
    files: list[SourceFile], batch_chars: int = BATCH_CHARS, seen: ContentSeen | None = None
) -> Iterable[list[tuple[SourceFile, str]]]:
    """The readable files with their texts, in order, in lists of about ``batch_chars``
    characters; with ``seen``, copies of files already read are left out (see read_text)."""
    batch: list[tuple[SourceFile, str]] = []
    n = 0
    for f in files:
        text = read_text(f, seen)
        if text is None:
            continue
        batch.append((f, text))
        n += len(text)
        if n >= batch_chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _tokenizer_sample(train: list[SourceFile], sample_chars: int) -> list[str]:
    out, n = [], 0
    for batch in text_batches(train, batch_chars=1):
        out += [t for _, t in batch]
        n += sum(len(t) for _, t in batch)
        if n >= sample_chars:
            break
    return out


def _encode_split(
    tok, files: list[SourceFile], path: Path, log: Callable[[str], None], label: str, seen: ContentSeen
) -> tuple[int, int, int]:
    """Stream ``files`` through the tokenizer into a ``.bin`` shard: (tokens, files, bytes)
    written. ``seen``: content digests of the files already written (copies are left out)."""
    width = 2 if tok.get_vocab_size() <= 2**16 else 4
    total_chars = sum(f.size for f in files)
    done, n_files, t0 = 0, 0, time.perf_counter()
    with TokenShardWriter(path, width) as writer:
        for batch in text_batches(files, seen=seen):
            # as every other text hydra-train reads: a source file that spells out
            # "<|endoftext|>" (tokenizer code) keeps it as text, and the end-of-text id marks only
            # the end of each file. batch=len: the batch's files in one encode call, as before
            texts = [t for _, t in batch]
            writer.append(encode_documents(tok, texts, batch=len(texts)))
            n_files += len(batch)
            done += sum(f.size for f, _ in batch)
            rate = done / max(1e-9, time.perf_counter() - t0) / 1e6
            log(f"tokenizing {label}: {done / 1e6:.0f}/{total_chars / 1e6:.0f} MB ({rate:.1f} MB/s)")
    return writer.count, n_files, done


def load_pyenv_corpus(
    *,
    vocab_size: int = 32000,
    extensions: str | Iterable[str] | None = None,
    roots: list[tuple[str, Path]] | None = None,
    cache: Path | None = None,
    sample_chars: int = TOKENIZER_SAMPLE_CHARS,
    log: Callable[[str], None] = print,
) -> PyenvCorpus:
    """The corpus from the cache, or built there (tokenizer, shards, meta.json) on first use.

    ``roots`` replaces the interpreter's folders (label "stdlib" or "site", folder): for tests and
    for racing on another source tree."""
    from hydra_train.corpus import cache_dir, writing_cache

    exts = parse_extensions(extensions)
    roots = dedupe_roots(roots) if roots is not None else environment_roots()
    if not roots:
        raise HydraDataError(
            "no Python library or site-packages folder was found to build the pyenv corpus from"
        )
    t0 = time.perf_counter()
    files = scan_sources(roots, exts)
    split = split_sources(files)
    if not split["train"] or not split["val"]:
        raise HydraDataError(
            f"pyenv corpus: {len(split['train'])} train and {len(split['val'])} validation files with "
            f"extensions {','.join(exts)} under {', '.join(str(r) for _, r in roots)}; it needs both"
        )
    key = cache_key(files, exts, vocab_size, sample_chars)
    folder = (cache or cache_dir()) / "corpora" / f"pyenv-{key}"
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            meta.pop("python", None)
            load_tokenizer(folder / "tokenizer.json")  # unreadable: rebuild below
            if all((folder / f"{s}.bin").is_file() for s in ("train", "val")):
                meta.update(folder=folder, cache_hit=True, build_s=time.perf_counter() - t0)
                return PyenvCorpus(**meta)
        except (OSError, ValueError, TypeError, HydraDataError) as exc:
            log(f"cached corpus {folder} is unusable ({exc}); building it again")
    with writing_cache(folder):  # checked before the tokenizer is trained
        return _build_pyenv(folder, files, split, roots, exts, key, vocab_size, sample_chars, t0, log)


def _build_pyenv(folder, files, split, roots, exts, key, vocab_size, sample_chars, t0, log) -> PyenvCorpus:
    """Build the corpus into the cache ``folder`` (tokenizer, shards, then meta.json)."""
    meta_path = folder / "meta.json"
    total_mb = sum(f.size for f in files) / 1e6
    log(f"pyenv corpus: {len(files)} files ({total_mb:.0f} MB) under {len(roots)} folders")
    sample = _tokenizer_sample(split["train"], sample_chars)
    n_sample = sum(len(t) for t in sample)
    log(f"training a byte-level BPE (vocab {vocab_size}) on {n_sample / 1e6:.1f}M characters ...")
    tok = train_bpe(sample, vocab_size)
    del sample
    atomic_write_bytes(folder / "tokenizer.json", tok.to_str().encode("utf-8"))
    seen = ContentSeen()  # train first: a validation file never repeats a training file
    written, duplicates = {}, {}
    for s in ("train", "val"):
        before = seen.copies
        written[s] = _encode_split(tok, split[s], folder / f"{s}.bin", log, s, seen)
        duplicates[s] = seen.copies - before
    by_ext: dict[str, int] = {}
    for f in files:
        ext = f.key.rsplit(".", 1)[-1].lower()
        by_ext[ext] = by_ext.get(ext, 0) + 1
    meta = dict(
        cache_key=key,
        roots=[f"{label}:{p}" for label, p in roots],
        extensions=list(exts),
        files={s: w[1] for s, w in written.items()},  # readable files actually tokenized
        bytes={s: w[2] for s, w in written.items()},
        tokens={s: w[0] for s, w in written.items()},
        by_extension=by_ext,
        vocab_size=int(tok.get_vocab_size()),
        duplicates=duplicates,
        python=sys.version.split()[0],
    )
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2).encode("utf-8"))
    meta.pop("python")
    return PyenvCorpus(folder=folder, cache_hit=False, build_s=time.perf_counter() - t0, **meta)
