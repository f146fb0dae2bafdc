"""``convert jsonl-to-pt`` and ``convert chat-to-pt``: text → tokenized ``.pt`` shards that
hydra-train reads (``--dataset OUT_DIR``).

Tokenizer: a local ``tokenizer.json`` (Hugging Face ``tokenizers`` format), or hydra-train's
default, the byte-level BPE it builds for its embedded corpus (built and cached on first use,
see hydra-train's README). It is copied into the output folder, so hydra-train finds it and its
vocabulary there. Every document is followed by the end-of-document id
(:func:`hydra_train.tokenizer.encode_documents`).

Layouts: ``stream`` (default): ``{"tokens": 1-D int32}`` per shard, which hydra-train cuts into
windows of any ``--seq_len``; ``rows``: the stream packed into rows of ``seq_len + 1`` tokens,
``{"input_ids": [N, seq_len + 1]}`` (the remainder that fills no row is dropped and counted).
A document goes to ``val/`` when sha1(its UTF-8 text), read as a fraction of 2**160, is below
``val_fraction`` (content-based, so re-running gives the same split); everything else goes to
``train/``, or to the output folder itself when ``val_fraction`` is 0.

Output folder: the shards are written into a staging folder inside it and moved in only once the
whole input is converted, so a conversion that fails (bad line, full disk) leaves the folder as it
was. The shards of an earlier conversion there (``partNNNNN.pt`` under its ``meta.json``) are
replaced; other data that ``hydra-train run --dataset OUT`` would read beside the new shards (the
input ``.jsonl`` itself, shards of another tool) is refused.

Chat template (``chat-to-pt``): each message becomes ``<|ROLE|>\\n`` + content + ``\\n`` with ROLE
one of system, user, assistant, tool; a conversation is its messages in order, then the
end-of-document id. Input lines are ``{"messages": [{"role": …, "content": …}, …]}`` or ShareGPT's
``{"conversations": [{"from": "human"|"gpt"|"system", "value": …}, …]}``. Role tags are plain text
to the tokenizer, and every token is a training target (hydra-train has no loss mask).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_diag.convert_output import (
    META_FORMAT,
    earlier_shards,
    missing_folders,
    move_into_place,
    remove_folders,
    staging_folder,
)
from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress

CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


def render_chat(messages: list[dict[str, Any]], where: str = "conversation") -> str:
    """The documented template over ``[{"role", "content"}, …]``; unknown roles are a DiagError."""
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DiagError(f'{where}: message {i} is not an object with "role" and "content"')
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise DiagError(
                f"{where}: message {i} has role {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise DiagError(f"{where}: message {i} has no text content")
        parts.append(f"<|{role}|>\n{content}\n")
    return "".join(parts)


def chat_messages(obj: Any, where: str) -> list[dict[str, Any]]:
    """Messages of one JSONL object in either accepted shape (see the module docstring)."""
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return obj["messages"]
    if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
        out = []
        for i, turn in enumerate(obj["conversations"]):
            if not isinstance(turn, dict):
                raise DiagError(f'{where}: turn {i} is not an object with "from" and "value"')
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise DiagError(
                    f"{where}: turn {i} comes from {turn.get('from')!r}; expected one of "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            out.append({"role": role, "content": turn.get("value")})
        return out
    raise DiagError(f'{where}: expected an object with "messages" or "conversations"')


def input_files(inputs: list[str], suffix: str = ".jsonl") -> list[Path]:
    """Files named directly, and the ``*suffix`` files of named folders, in name order."""
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(suffix))
        elif p.is_file():
            files.append(p)
        else:
            raise DiagError(f"input {p} does not exist")
    if not files:
        raise DiagError(f"no {suffix} files in {', '.join(inputs)}")
    return files


def read_jsonl(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed object) for every non-empty line; bad JSON is a DiagError naming it."""
    for f in files:
        with open(f, "rb") as fh:  # bytes, decoded line by line: an undecodable line is named
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DiagError(
                        f"{f}:{n}: not UTF-8 text (byte {exc.start + 1} of the line); re-encode the file"
                    ) from None
                if not line.strip():
                    continue
                try:
                    yield f"{f}:{n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DiagError(f"{f}:{n}: not valid JSON ({exc.msg})") from None


def text_documents(files: list[Path], field: str) -> Iterator[str]:
    for where, obj in read_jsonl(files):
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise DiagError(f'{where}: each line must be an object with a "{field}" string')
        yield obj[field]


def chat_documents(files: list[Path]) -> Iterator[str]:
    for where, obj in read_jsonl(files):
        yield render_chat(chat_messages(obj, where), where)


def load_tokenizer_file(path: str):
    """The tokenizer of a ``tokenizer.json`` (``--tokenizer``), or a DiagError naming the file when it
    is missing or no tokenizer (``convert`` and ``eval checkpoint`` refuse it alike)."""
    from hydra_train.errors import HydraDataError
    from hydra_train.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except HydraDataError as exc:
        raise DiagError(str(exc)) from None


def resolve_tokenizer(tokenizer: str | None, vocab_size: int, progress: Progress):
    """(tokenizer, path of its tokenizer.json): the given file, or hydra-train's default one."""
    from hydra_train.errors import HydraDataError

    if tokenizer:
        return load_tokenizer_file(tokenizer), Path(tokenizer)
    try:
        from hydra_train.corpus import cache_dir, load_stdlib_corpus
        from hydra_train.tokenizer import cached_corpus_tokenizer

        progress("hydra-train's default tokenizer (built on first use)")
        tok, path, _ = cached_corpus_tokenizer(
            load_stdlib_corpus("stdlib"), vocab_size, cache_dir(), log=progress
        )
        return tok, path
    except HydraDataError as exc:
        raise DiagError(str(exc)) from None


def _save_shard(path: Path, obj: dict[str, torch.Tensor]) -> None:
    from hydra_train.atomic_files import atomic_write_bytes

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


class ShardWriter:
    """Collects token ids of one split and writes ``part{k:05d}.pt`` shards as they fill."""

    def __init__(self, folder: Path, layout: str, seq_len: int, tokens_per_shard: int):
        self.folder, self.layout, self.row = folder, layout, seq_len + 1
        self.per_shard = (
            max(tokens_per_shard // self.row * self.row, self.row) if layout == "rows" else tokens_per_shard
        )
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.files: list[str] = []
        self.tokens_written = 0
        self.documents = 0
        self.dropped = 0

    def add(self, ids: np.ndarray, documents: int) -> None:
        self.documents += documents
        self.buf.append(ids)
        self.buffered += ids.size
        while self.buffered >= self.per_shard:
            self._flush(self.per_shard)

    def _flush(self, n: int) -> None:
        flat = np.concatenate(self.buf) if self.buf else np.zeros(0, np.int64)
        head, rest = flat[:n], flat[n:]
        self.buf, self.buffered = ([rest] if rest.size else []), rest.size
        if self.layout == "rows":
            usable = head.size // self.row * self.row
            self.dropped += head.size - usable
            head = head[:usable]
            if not head.size:
                return
            obj = {"input_ids": torch.from_numpy(head.astype(np.int32).reshape(-1, self.row))}
        else:
            if not head.size:
                return
            obj = {"tokens": torch.from_numpy(head.astype(np.int32))}
        path = self.folder / f"part{len(self.files):05d}.pt"
        _save_shard(path, obj)
        self.files.append(str(path))
        self.tokens_written += int(head.size)

    def close(self) -> None:
        if self.buffered:
            self._flush(self.buffered)


def write_shards(
    documents: Iterator[str],
    out_dir: str,
    tokenizer: str | None = None,
    vocab_size: int = 4096,
    layout: str = "stream",
    seq_len: int = 2048,
    tokens_per_shard: int = 16_000_000,
    val_fraction: float = 0.0,
    batch_docs: int = 256,
    progress: Progress = no_progress,
    tool: str = "convert",
) -> dict[str, Any]:
    """Tokenize ``documents`` and write the shards (see the module docstring)."""
    from hydra_train.tokenizer import encode_documents

    if layout not in ("stream", "rows"):
        raise DiagUsageError(f"--layout {layout!r}: use stream or rows")
    if not 0.0 <= val_fraction < 1.0:
        raise DiagUsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir).expanduser()
    earlier = earlier_shards(out)  # before any work: refused data in OUT is one line at once
    tok, tok_path = resolve_tokenizer(tokenizer, vocab_size, progress)
    made = missing_folders(out)
    stage = staging_folder(out)
    try:
        split_dirs = {"train": "train", "val": "val"} if val_fraction > 0 else {"train": ""}
        writers = {
            k: ShardWriter(stage / v, layout, seq_len, tokens_per_shard) for k, v in split_dirs.items()
        }
        max_id = -1
        pending: list[str] = []

        def drain() -> None:
            nonlocal max_id
            by_split: dict[str, list[str]] = {k: [] for k in writers}
            for text in pending:
                # the whole hash as a fraction of 1: its first byte alone sent no document to val/
                # below a val_fraction of 1/256 and rounded every other one down to a multiple of it
                digest = hashlib.sha1(text.encode("utf-8")).digest()
                val = val_fraction > 0 and int.from_bytes(digest, "big") < val_fraction * 2**160
                by_split["val" if val else "train"].append(text)
            for split, texts in by_split.items():
                if texts:
                    ids = encode_documents(tok, texts).astype(np.int64)  # one batched call per split
                    if ids.size:
                        max_id = max(max_id, int(ids.max()))
                    writers[split].add(ids, len(texts))
            pending.clear()

        for n, doc in enumerate(documents, 1):
            pending.append(doc)
            if len(pending) >= batch_docs:
                drain()
                progress(f"{n} documents")
        drain()
        for w in writers.values():
            w.close()
        vocab = tok.get_vocab_size()
        if max_id >= vocab:
            raise DiagError(f"the tokenizer produced id {max_id} >= its vocabulary size {vocab}")
        splits = {
            k: {
                "documents": w.documents,
                "tokens": w.tokens_written,
                "shards": len(w.files),
                "dropped_tokens": w.dropped,
                "files": [str(out / Path(f).relative_to(stage)) for f in w.files],
            }
            for k, w in writers.items()
        }
        if not any(s["tokens"] for s in splits.values()):
            raise DiagError("no tokens were written: the input has no documents (or every row was too short)")
        if tok_path.resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tok_path, stage / "tokenizer.json")
        meta = {
            "format": META_FORMAT,
            "vocab_size": vocab,
            "layout": layout,
            "seq_len": seq_len if layout == "rows" else None,
            "tokenizer": str(tok_path),
            "splits": splits,
        }
        (stage / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    except BaseException:  # a failed conversion leaves OUT as it was: absent, if it was
        shutil.rmtree(stage, ignore_errors=True)
        remove_folders(made)
        raise
    move_into_place(stage, out, earlier)
    return {"tool": tool, "out_dir": str(out), **meta}


def jsonl_to_pt(inputs: list[str], out_dir: str, text_field: str = "text", **kw: Any) -> dict[str, Any]:
    """Text JSONL (one ``{"text": …}`` per line) → shards."""
    files = input_files(inputs)
    return write_shards(text_documents(files, text_field), out_dir, tool="convert_nemotron_jsonl_to_pt", **kw)


def chat_to_pt(inputs: list[str], out_dir: str, **kw: Any) -> dict[str, Any]:
    """Chat JSONL → rendered conversations → shards."""
    files = input_files(inputs)
    return write_shards(chat_documents(files), out_dir, tool="convert_small_chat_to_pt", **kw)


def render_convert(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    rows = [{"split": k, **{c: v for c, v in s.items() if c != "files"}} for k, s in result["splits"].items()]
    console.print(
        rows_table(
            f"{result['tool']}: {result['out_dir']} ({result['layout']}, vocab {result['vocab_size']}, "
            f"tokenizer {result['tokenizer']})",
            rows,
        )
    )
    console.print(f"train with: hydra-train run --dataset {result['out_dir']}", highlight=False)
