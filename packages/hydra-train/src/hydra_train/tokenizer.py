"""Byte-level BPE tokenizers: built for the embedded corpus (and cached), or loaded from a file.

The tokenizer of the embedded corpus is trained with the ``tokenizers`` package on a deterministic
subset of the corpus's *train* split (files in path order until ``TRAIN_SUBSET_CHARS`` characters),
so validation text never shapes the vocabulary. It is cached as
``<cache>/tokenizers/<corpus>-<fingerprint>-v<vocab>.json``; a second run with the same corpus and
vocabulary size loads it instead of training again. Id 0 is ``<|endoftext|>``, appended after every
document so that the model sees where one file ends and the next begins.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hydra_train.atomic_files import atomic_write_bytes
from hydra_train.errors import HydraDataError

EOS_TOKEN = "<|endoftext|>"
TRAIN_SUBSET_CHARS = 4_000_000
MIN_VOCAB = 300  # 256 byte symbols, the special token and a few merges


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False):
    """A byte-level BPE with ``vocab_size`` entries (or fewer when the text has fewer merges).
    ``show_progress``: the tokenizers library's progress bars on stderr (for a terminal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise HydraDataError(f"--vocab_size {vocab_size} is too small for a byte-level BPE (min {MIN_VOCAB})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | Path):
    """Load a ``tokenizer.json`` (Hugging Face ``tokenizers`` format); errors name the file."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():  # e.g. a Hugging Face model folder: it exists, so "does not exist" would mislead
        raise HydraDataError(f"tokenizer {p} is a folder, not a tokenizer.json file; pass the file in it")
    if not p.is_file():
        raise HydraDataError(f"tokenizer file {p} does not exist")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:
        raise HydraDataError(f"tokenizer file {p} could not be read: {exc}") from None


def eos_id(tok) -> int:
    """The id appended after each document: ``<|endoftext|>`` or the tokenizer's ``</s>``-like token."""
    for name in (EOS_TOKEN, "</s>", "<eos>", "[SEP]"):
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise HydraDataError(
        f"the tokenizer has none of the end-of-document tokens {EOS_TOKEN!r}, '</s>', '<eos>', '[SEP]'"
    )


def _literal_ids(tok, marker: str) -> list[int]:
    """The ids of ``marker`` (the end-of-document token's string) read as plain text. From a copy
    of ``tok`` that matches no special token: the caller's tokenizer is never changed (another
    thread may be encoding with it; the tokenizers library releases the GIL while it encodes)."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return plain.encode(marker, add_special_tokens=False).ids


def encode_documents(tok, texts: list[str], batch: int = 256) -> np.ndarray:
    """Token ids of all ``texts``, each followed by the end-of-document id, as one uint32 array.
    The end-of-document id appears only there: its string written inside a text (Python sources
    that handle GPT-2 tokenizers, web pages) is encoded as the characters it is (matched as the
    special token, it would be a document boundary in mid-document, and decoding would drop it);
    the text's other special tokens still match."""
    eos = eos_id(tok)
    marker = tok.id_to_token(eos)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: skips offsets
    literal: list[int] | None = None  # the marker's plain-text ids, made on first need
    parts: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        plain = [t for t in chunk if marker not in t]
        encoded = iter(encode(plain, add_special_tokens=False)) if plain else iter(())
        for text in chunk:
            if marker not in text:
                ids = next(encoded).ids
            else:  # the pieces around each marker in one batched call, the marker's text between
                literal = _literal_ids(tok, marker) if literal is None else literal
                ids = []
                for k, enc in enumerate(encode(text.split(marker), add_special_tokens=False)):
                    ids += literal + enc.ids if k else enc.ids
            parts.append(np.asarray(ids, dtype=np.uint32))
            parts.append(np.asarray([eos], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def cached_corpus_tokenizer(corpus, vocab_size: int, cache: Path, log=print):
    """The corpus's tokenizer from the cache, trained and stored there on first use."""
    path = cache / "tokenizers" / f"{corpus.name}-{corpus.fingerprint}-v{vocab_size}.json"
    if path.is_file():
        try:
            return load_tokenizer(path), path, True
        except HydraDataError:
            log(f"cached tokenizer {path} is unreadable; training it again")
    subset: list[str] = []
    n = 0
    for doc in corpus.train:
        subset.append(doc.text)
        n += len(doc.text)
        if n >= TRAIN_SUBSET_CHARS:
            break
    from hydra_train.corpus import writing_cache

    with writing_cache(path.parent):  # checked before the training, not only after it
        log(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {n / 1e6:.1f}M characters ...")
        tok = train_bpe(subset, vocab_size)
        atomic_write_bytes(path, tok.to_str().encode("utf-8"))
    return tok, path, False
