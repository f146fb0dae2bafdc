"""The pyenv corpus: file selection over several roots, the path-hash split, the on-disk cache and
its key, extension opt-in, and the streamed shards against a direct encoding of the same files."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from hydra_train.corpus import is_validation_path
from hydra_train.errors import HydraDataError
from hydra_train.pyenv_corpus import (
    load_pyenv_corpus,
    parse_extensions,
    scan_sources,
    split_sources,
)
from hydra_train.shards import TokenShardWriter, open_shard
from hydra_train.tokenizer import encode_documents, load_tokenizer

VOCAB = 400


def _tree(root: Path) -> Path:
    """A fake environment: a library folder with a nested site-packages, and a second site root."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "value", "for", "in", "if", "None", "(", ")"]
    lib, site2 = root / "lib", root / "site2"
    for i in range(80):
        text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(20 + i)) + "\n"
        (lib / f"pkg{i % 7}").mkdir(parents=True, exist_ok=True)
        (lib / f"pkg{i % 7}" / f"mod{i}.py").write_text(text)
    (lib / "site-packages" / "inner").mkdir(parents=True)
    (lib / "site-packages" / "inner" / "a.py").write_text("x = 1\n" * 50)
    (lib / "__pycache__").mkdir()
    (lib / "__pycache__" / "cached.py").write_text("skip me\n")
    (lib / "ext.c").write_text("int main(void) { return 0; }\n" * 30)
    (lib / "notes.md").write_text("# notes\n" * 30)
    (lib / "binary.py").write_bytes(b"\0\1\2" * 20)
    site2.mkdir()
    (site2 / "b.py").write_text("y = 2\n" * 40)
    (site2 / "inner").mkdir()
    (site2 / "inner" / "a.py").write_text("shadowed = True\n")  # the same key as lib/site-packages
    return root


def _roots(root: Path) -> list[tuple[str, Path]]:
    # the site root nested inside the library, a second site root, and a duplicate of the first
    return [
        ("stdlib", root / "lib"),
        ("site", root / "lib" / "site-packages"),
        ("site", root / "site2"),
        ("site", root / "lib" / "site-packages"),
    ]


def test_selection_keys_and_split(tmp_path):
    root = _tree(tmp_path)
    files = scan_sources(_roots(root), ("py",))
    keys = [f.key for f in files]
    assert keys == sorted(keys) and len(keys) == len(set(keys))
    assert "site/inner/a.py" in keys and "site/b.py" in keys
    a = next(f for f in files if f.key == "site/inner/a.py")
    assert Path(a.path).parent.parent.name == "site-packages"  # the first root holding the key wins
    assert not any("site-packages" in k or "__pycache__" in k for k in keys)  # nested root walked once
    assert "stdlib/ext.c" not in keys
    assert sum(k.startswith("stdlib/pkg") for k in keys) == 80
    split = split_sources(files)
    assert {f.key for f in split["val"]} == {k for k in keys if is_validation_path(k)}
    assert len(split["train"]) + len(split["val"]) == len(files)
    with_c = {f.key for f in scan_sources(_roots(root), ("py", "c", "md"))}
    assert {"stdlib/ext.c", "stdlib/notes.md"} <= with_c


def test_extension_parsing():
    assert parse_extensions("py, .PYI,c,py") == ("c", "py", "pyi")
    assert parse_extensions(None) == ("py",)
    with pytest.raises(HydraDataError, match="--extensions"):
        parse_extensions("py,../x")


def test_build_cache_hit_and_shards_match_direct_encoding(tmp_path):
    root = _tree(tmp_path / "tree")
    logs: list[str] = []
    built = load_pyenv_corpus(
        vocab_size=VOCAB, roots=_roots(root), cache=tmp_path / "cache", sample_chars=50_000, log=logs.append
    )
    assert not built.cache_hit
    assert built.files["train"] + built.files["val"] == 82  # 80 + a.py + b.py; binary.py is dropped
    desc = built.describe()
    assert "files" in desc and "MB" in desc and "tokens" in desc and "train" in desc and "val" in desc
    # the shards hold exactly what encoding the split's readable files, in hash order, gives
    tok = load_tokenizer(built.tokenizer_path)
    split = split_sources(scan_sources(_roots(root), ("py",)))
    for s in ("train", "val"):
        texts = [Path(f.path).read_text() for f in split[s] if f.key != "stdlib/binary.py"]
        expect = encode_documents(tok, texts)
        shard = open_shard(built.folder / f"{s}.bin")
        np.testing.assert_array_equal(np.asarray(shard.tokens), expect)
        assert built.tokens[s] == expect.size
        assert shard.tokens.dtype == np.dtype("<u2")
    # second load: a cache hit, nothing re-tokenized
    logs.clear()
    again = load_pyenv_corpus(
        vocab_size=VOCAB, roots=_roots(root), cache=tmp_path / "cache", sample_chars=50_000, log=logs.append
    )
    assert again.cache_hit and again.folder == built.folder and again.tokens == built.tokens
    assert not any("tokenizing" in m for m in logs)
    # a touched file (new mtime) or an opted-in extension is another corpus
    f = root / "lib" / "pkg1" / "mod1.py"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = load_pyenv_corpus(
        vocab_size=VOCAB, roots=_roots(root), cache=tmp_path / "cache", sample_chars=50_000, log=logs.append
    )
    assert not touched.cache_hit and touched.cache_key != built.cache_key
    more = load_pyenv_corpus(
        vocab_size=VOCAB,
        extensions="py,c,md",
        roots=_roots(root),
        cache=tmp_path / "cache",
        sample_chars=50_000,
        log=logs.append,
    )
    assert more.by_extension == {"py": 83, "c": 1, "md": 1}  # binary.py found, then dropped
    assert sum(more.tokens.values()) > sum(touched.tokens.values())


def test_identical_files_are_tokenized_once_training_split_first(tmp_path):
    """A file whose bytes equal another's is left out: of training copies all but the first in
    hash order, and every validation copy of a training file; counted in the description."""
    root = _tree(tmp_path / "tree")
    roots = _roots(root)
    split = split_sources(scan_sources(roots, ("py",)))
    train_src, val_src = split["train"][3], split["val"][0]
    # copies under new names: two of a training file, one of a validation file, one of a training
    # file that will sort into validation (found by trying names)
    copies = {"dup_a.py": train_src, "dup_b.py": train_src, "dup_c.py": val_src}
    name = next(f"x{i}.py" for i in range(500) if is_validation_path(f"stdlib/pkg0/x{i}.py"))
    copies[name] = train_src
    for fn, src in copies.items():
        (root / "lib" / "pkg0" / fn).write_bytes(Path(src.path).read_bytes())
    built = load_pyenv_corpus(
        vocab_size=VOCAB, roots=roots, cache=tmp_path / "cache", sample_chars=50_000, log=lambda m: None
    )
    assert sum(built.duplicates.values()) == 4
    assert built.files["train"] + built.files["val"] == 82  # as without the copies
    assert built.duplicates["val"] >= 1  # the training file's copy sorted into validation
    assert "4 duplicate files left out" in built.describe()
    # shards: each distinct text once; validation holds no training document
    tok = load_tokenizer(built.tokenizer_path)
    train_ids = np.asarray(open_shard(built.folder / "train.bin").tokens)
    val_ids = np.asarray(open_shard(built.folder / "val.bin").tokens)
    doc = encode_documents(tok, [Path(train_src.path).read_text()])
    hits = [
        i
        for i in range(train_ids.size - doc.size + 1)
        if train_ids[i] == doc[0] and np.array_equal(train_ids[i : i + doc.size], doc)
    ]
    assert len(hits) == 1
    assert not any(np.array_equal(val_ids[i : i + doc.size], doc) for i in range(val_ids.size - doc.size + 1))


def test_real_stdlib_subset_is_deterministic(tmp_path):
    """A few real standard-library packages (bounded size): two builds in two caches agree."""
    std = Path(sysconfig.get_paths()["stdlib"])
    roots = [("stdlib", std / "json"), ("stdlib", std / "email")]
    if not all(p.is_dir() for _, p in roots):
        pytest.skip("this interpreter ships without json/email sources")
    a = load_pyenv_corpus(vocab_size=VOCAB, roots=roots, cache=tmp_path / "a", sample_chars=200_000, log=str)
    b = load_pyenv_corpus(vocab_size=VOCAB, roots=roots, cache=tmp_path / "b", sample_chars=200_000, log=str)
    assert a.cache_key == b.cache_key and a.files == b.files and a.tokens == b.tokens
    for s in ("train", "val"):
        np.testing.assert_array_equal(
            np.asarray(open_shard(a.folder / f"{s}.bin").tokens),
            np.asarray(open_shard(b.folder / f"{s}.bin").tokens),
        )
    assert a.files["val"] >= 1 and a.tokens["train"] > 10 * a.tokens["val"] / 2


def test_errors(tmp_path):
    (tmp_path / "only").mkdir()
    with pytest.raises(HydraDataError, match="needs both"):
        load_pyenv_corpus(vocab_size=VOCAB, roots=[("stdlib", tmp_path / "only")], cache=tmp_path, log=str)


def test_shard_writer_is_atomic(tmp_path):
    path = tmp_path / "s.bin"
    with pytest.raises(RuntimeError), TokenShardWriter(path, 2) as w:
        w.append(np.arange(10, dtype=np.uint32))
        raise RuntimeError("interrupted")
    assert not path.exists() and not list(tmp_path.iterdir())
    with TokenShardWriter(path, 2) as w:
        w.append(np.arange(10, dtype=np.uint32))
        w.append(np.array([], dtype=np.uint32))
        w.append(np.array([65535], dtype=np.uint32))
    shard = open_shard(path)
    np.testing.assert_array_equal(np.asarray(shard.tokens), [*range(10), 65535])
    assert shard.max_token_id == 65535
    with pytest.raises(ValueError, match="does not fit"), TokenShardWriter(tmp_path / "t.bin", 2) as w:
        w.append(np.array([70000], dtype=np.uint32))


def test_hydra_train_dataset_pyenv(tmp_path, monkeypatch):
    """``--dataset pyenv`` in hydra-train: the corpus of the (here: fake) environment, both splits."""
    import hydra_train.pyenv_corpus as pc
    from hydra_train.data_sources import load_data

    root = _tree(tmp_path / "tree")
    monkeypatch.setattr(pc, "environment_roots", lambda: pc.dedupe_roots(_roots(root)))
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    bundle = load_data("pyenv", seq_len=16, vocab_size=VOCAB, default_vocab=32000, log=str)
    assert bundle.vocab_size <= VOCAB and bundle.train.num_windows > bundle.val.num_windows > 0
    assert bundle.tokenizer_path.is_file() and "pyenv" in bundle.description


def test_a_literal_end_of_text_in_a_source_file_is_text(tmp_path):
    """Tokenizer code spells out "<|endoftext|>"; the race's corpus keeps it as the characters it
    is (encode_documents), so the end-of-text id marks only the end of each file."""
    from hydra_train.pyenv_corpus import FORMAT_VERSION
    from hydra_train.tokenizer import EOS_TOKEN, eos_id

    root = _tree(tmp_path / "tree")
    (root / "site2" / "gpt2_tok.py").write_text(f'EOT = "{EOS_TOKEN}"\nsplit = text.split(EOT)\n' * 5)
    built = load_pyenv_corpus(
        vocab_size=VOCAB, roots=_roots(root), cache=tmp_path / "cache", sample_chars=50_000, log=str
    )
    tok = load_tokenizer(built.tokenizer_path)
    eos = eos_id(tok)
    split = split_sources(scan_sources(_roots(root), ("py",)))
    spelled = 0
    for s in ("train", "val"):
        ids = np.asarray(open_shard(built.folder / f"{s}.bin").tokens)
        assert int((ids == eos).sum()) == built.files[s]  # one per file, none inside one
        texts = [Path(f.path).read_text() for f in split[s] if f.key != "stdlib/binary.py"]
        np.testing.assert_array_equal(ids, encode_documents(tok, texts))
        spelled += sum(EOS_TOKEN in t for t in texts)
    assert spelled == 1
    assert tok.decode(encode_documents(tok, [f'"{EOS_TOKEN}"'])[:-1].tolist()) == f'"{EOS_TOKEN}"'
    # the shards of earlier builds matched it as the special token: another format, not reused
    assert FORMAT_VERSION >= 3
