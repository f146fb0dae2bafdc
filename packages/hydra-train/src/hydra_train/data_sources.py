"""Turn ``--dataset`` into train and validation datasets.

``--dataset`` is one of

* ``pyenv``: every ``.py`` of the interpreter's library and installed packages
  (:mod:`hydra_train.pyenv_corpus`), with its own cached tokenizer and shards;
* ``stdlib`` / ``stdlib-full``: the embedded corpus (:mod:`hydra_train.corpus`), tokenized with its
  cached BPE; the token ids are cached too, as ``.bin`` shards under
  ``<cache>/corpora/<corpus>-<fingerprint>-v<vocab>/{train,val}.bin``;
* a name: the folder ``$HYDRA_DATA_ROOT/<name>/`` (e.g. ``finefineweb-sequential``);
* a path to a folder of shards or to one shard file;
* a Hugging Face dataset folder written by ``save_to_disk`` (:mod:`hydra_train.text_tables`): its
  ``train`` split, and its ``validation``/``val``/``valid`` split when there is one.

Inside a folder (its ``train/`` subfolder when there is one): shards are the files ending in
``.bin``, ``.pt``, ``.jsonl``, ``.txt``, ``.parquet`` or ``.arrow``, in name order, hidden files
(names starting with ``.``) aside; any other format is an error that lists these. Neighbouring
text files are packed into one stream (:func:`hydra_train.shards.open_shards`); shards shorter
than one window give no training data, and are reported (logged and in the description).
Validation data is, in order of preference, the ``val/`` (or ``validation/``) subfolder beside a
``train/`` one or beside the shards themselves (with the shards named as below); the shards whose
name contains ``val``/``valid``/``validation`` as a word; otherwise the last 1% of the training
windows (at least one). Text data (``.jsonl``,
``.txt``, tables; the text is the ``--text_column`` field, default ``text``) needs a tokenizer:
``--tokenizer`` or a ``tokenizer.json`` in the folder (``hydra-train tokenizer train DATA`` writes
one there). The vocabulary is ``--vocab_size``, else the
tokenizer's, else ``vocab_size`` from a ``meta.json`` in the folder, else the model preset's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hydra_train.config import EMBEDDED_CORPORA as EMBEDDED_NAMES
from hydra_train.corpus import cache_dir, load_stdlib_corpus, writing_cache
from hydra_train.dataset import TokenDataset, WindowView
from hydra_train.errors import HydraDataError, short_error
from hydra_train.options import train_options
from hydra_train.shards import SHARD_SUFFIXES, Shard, open_shard, open_shards, write_token_shard
from hydra_train.text_tables import hf_train_val, is_hf_dataset_dir, unsupported_message
from hydra_train.tokenizer import cached_corpus_tokenizer, encode_documents, load_tokenizer

VAL_FRACTION = 0.01
_VAL_NAME = re.compile(r"(^|[^a-z])(val|valid|validation)([^a-z]|$)", re.IGNORECASE)


@dataclass
class DataBundle:
    train: TokenDataset | WindowView
    val: TokenDataset | WindowView
    vocab_size: int
    seq_len: int
    description: str
    tokenizer_path: Path | None = None


def token_count(n: int) -> str:
    """A token count as a person reads it: ``1,452`` below a million (``0.00M`` said nothing about a
    small test set), then ``12.35M`` and ``1.20B``."""
    if n < 1_000_000:
        return f"{n:,}"
    return f"{n / 1e6:.2f}M" if n < 1_000_000_000 else f"{n / 1e9:.2f}B"


def data_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that may be data, in name order: hidden ones are not (macOS's
    "._name" AppleDouble files, editors' and writers' temporaries). Tokenizer training lists a
    folder the same way (text_tables.iter_texts)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _shard_files(folder: Path) -> list[Path]:
    return [p for p in data_files(folder) if p.suffix.lower() in SHARD_SUFFIXES]


def resolve_dataset_path(name: str) -> Path:
    """A name under ``$HYDRA_DATA_ROOT`` first, then a path; the error lists what was tried."""
    tried = []
    root = train_options().data_root
    if root is not None and "/" not in name and os.sep not in name:
        cand = root / name
        if cand.exists():
            return cand
        tried.append(str(cand))
    p = Path(name).expanduser()
    if p.exists():
        return p
    tried.append(str(p))
    hint = "" if root is not None else " (HYDRA_DATA_ROOT is not set)"
    raise HydraDataError(f"dataset {name!r} not found; looked for {' and '.join(tried)}{hint}")


def _pyenv(vocab_size: int, seq_len: int, log) -> DataBundle:
    from hydra_train.pyenv_corpus import load_pyenv_corpus

    corpus = load_pyenv_corpus(vocab_size=vocab_size, log=log)
    log(f"corpus {corpus.describe()}")
    vocab = corpus.vocab_size
    train = TokenDataset([open_shard(corpus.train_path)], seq_len, vocab, name="pyenv:train")
    val = TokenDataset([open_shard(corpus.val_path)], seq_len, vocab, name="pyenv:val")
    return DataBundle(train, val, vocab, seq_len, corpus.describe(), corpus.tokenizer_path)


def _embedded(name: str, vocab_size: int, seq_len: int, log) -> DataBundle:
    if name == "pyenv":
        return _pyenv(vocab_size, seq_len, log)
    corpus = load_stdlib_corpus(name)
    log(f"corpus {corpus.describe()}")
    cache = cache_dir()
    tok, tok_path, hit = cached_corpus_tokenizer(corpus, vocab_size, cache, log=log)
    if hit:
        log(f"tokenizer loaded from cache {tok_path}")
    vocab = tok.get_vocab_size()
    folder = cache / "corpora" / f"{corpus.name}-{corpus.fingerprint}-v{vocab_size}"
    datasets = {}
    for split, docs in (("train", corpus.train), ("val", corpus.val)):
        path = folder / f"{split}.bin"
        shard = None
        if path.is_file():
            try:
                shard = open_shard(path)
            except HydraDataError as exc:
                log(f"cached corpus shard unusable ({exc}); tokenizing again")
        if shard is None:
            with writing_cache(folder):
                log(f"tokenizing the {split} split ({len(docs)} files) ...")
                write_token_shard(path, encode_documents(tok, [d.text for d in docs]))
            shard = open_shard(path)
        datasets[split] = TokenDataset([shard], seq_len, vocab, name=f"{corpus.name}:{split}")
    desc = (
        f"{corpus.name} (embedded): {token_count(datasets['train'].num_tokens)} train / "
        f"{token_count(datasets['val'].num_tokens)} val tokens, vocab {vocab}"
    )
    return DataBundle(datasets["train"], datasets["val"], vocab, seq_len, desc, tok_path)


def _find_tokenizer(explicit: str | None, folder: Path):
    if explicit:
        return load_tokenizer(explicit), Path(explicit)
    cand = folder / "tokenizer.json"
    if cand.is_file():
        return load_tokenizer(cand), cand
    return None, None


def _hf_dataset(path: Path, tok, tok_path, vocab: int, seq_len: int, column: str, name: str) -> DataBundle:
    """A ``save_to_disk`` folder: the train split, and its validation split or the held-out tail."""
    if tok is None:
        raise HydraDataError(
            f"{path}: text data needs a tokenizer; pass --tokenizer path/to/tokenizer.json or build one "
            f"beside the data: hydra-train tokenizer train {path} --vocab_size N"
        )
    train_docs, val_docs = hf_train_val(path, column)
    train_ds = TokenDataset(
        [_text_shard(path / "train", tok, train_docs)], seq_len, vocab, name=f"{name}:train"
    )
    if val_docs:
        val = TokenDataset(
            [_text_shard(path / "validation", tok, val_docs)], seq_len, vocab, name=f"{name}:val"
        )
        train, how = train_ds, "validation split"
    else:
        n_val = max(1, round(train_ds.num_windows * VAL_FRACTION))
        train, val = train_ds.split_tail(n_val)
        how = f"last {n_val} windows held out for validation"
    desc = f"{path} (Hugging Face dataset): {token_count(train_ds.num_tokens)} tokens, {how}, vocab {vocab}"
    return DataBundle(train, val, vocab, train_ds.seq_len, desc, tok_path)


def _text_shard(where: Path, tok, docs: list[str]) -> Shard:
    arr = encode_documents(tok, docs)
    return Shard(where, arr, int(arr.max()) if arr.size else None)


def _meta_vocab(folder: Path) -> int | None:
    import json

    meta = folder / "meta.json"
    if not meta.is_file():
        return None
    try:
        v = json.loads(meta.read_text()).get("vocab_size")
    except Exception as exc:
        raise HydraDataError(f"{meta}: unreadable ({short_error(exc)})") from None
    return int(v) if v is not None else None


def load_data(
    dataset: str,
    *,
    seq_len: int,
    vocab_size: int | None,
    default_vocab: int,
    tokenizer: str | None = None,
    text_column: str = "text",
    log=print,
) -> DataBundle:
    """Open ``dataset`` (see the module docstring) for sequences of ``seq_len`` tokens."""
    if dataset in EMBEDDED_NAMES:
        return _embedded(dataset, vocab_size or default_vocab, seq_len, log)
    path = resolve_dataset_path(dataset)
    folder = path if path.is_dir() else path.parent
    tok, tok_path = _find_tokenizer(tokenizer, folder)
    vocab = vocab_size or (tok.get_vocab_size() if tok is not None else None) or _meta_vocab(folder)
    vocab = vocab or default_vocab

    if is_hf_dataset_dir(path):
        return _hf_dataset(path, tok, tok_path, vocab, seq_len, text_column, dataset)

    def open_all(files: list[Path]) -> list[Shard]:
        return open_shards(files, tok, text_column, log)

    if path.is_file():
        train_files, val_files = [path], []
    else:
        sub_train = path / "train"
        sub_val = next((path / s for s in ("val", "validation") if (path / s).is_dir()), None)
        # a train/ folder holds the training shards with or without a val/ beside it (the
        # tokenizer trainer, text_tables.iter_texts, reads the same folder)
        where = sub_train if sub_train.is_dir() else path
        if sub_train.is_dir() and sub_val is not None:
            train_files, val_files = _shard_files(sub_train), _shard_files(sub_val)
        else:
            files = _shard_files(where)
            val_files = [f for f in files if _VAL_NAME.search(f.stem)]
            train_files = [f for f in files if f not in val_files]
            if sub_val is not None and train_files:  # shards with a val/ folder beside them
                val_files = _shard_files(sub_val) + val_files
            if val_files and not train_files:
                raise HydraDataError(
                    f"{where}: every shard ({', '.join(f.name for f in val_files[:3])}"
                    f"{', ...' if len(val_files) > 3 else ''}) is named like validation data "
                    "(val/valid/validation), so none is left for training"
                )
        if not train_files:
            raise HydraDataError(unsupported_message(where, [f for f in where.rglob("*") if f.is_file()]))
    train_ds = TokenDataset(open_all(train_files), seq_len, vocab, name=f"{dataset}:train")
    opened = {"train": train_ds}
    if val_files:
        val_ds = TokenDataset(open_all(val_files), train_ds.seq_len, vocab, name=f"{dataset}:val")
        opened["validation"] = val_ds
        train, val = train_ds, val_ds
        how = f"{len(val_files)} validation shard(s)"
    else:
        n_val = max(1, round(train_ds.num_windows * VAL_FRACTION))
        train, val = train_ds.split_tail(n_val)
        how = f"last {n_val} windows held out for validation"
    tokens = token_count(train_ds.num_tokens)
    desc = f"{path}: {len(train_files)} shard(s), {tokens} tokens, {how}, vocab {vocab}"
    for split, ds in opened.items():
        note = ds.short_shards_note()
        if note:  # said when the run starts, and kept in the description the run records
            log(f"warning: {split} data: {note}")
            desc += f"; {split}: {note}"
    return DataBundle(train, val, vocab, train_ds.seq_len, desc, tok_path)
