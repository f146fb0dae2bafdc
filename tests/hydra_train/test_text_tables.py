"""The user's own text: .parquet / .arrow tables and Hugging Face datasets with a text column,
``hydra-train tokenizer train`` and a run that finds its tokenizer, unsupported formats."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.data_sources import load_data
from hydra_train.errors import HydraDataError
from hydra_train.tokenizer import eos_id, load_tokenizer, train_bpe

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

runner = CliRunner()
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "def",
    "class",
    "return",
    "import",
    "yield",
]


def make_docs(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(40, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t = train_bpe(make_docs(40, 99), 400)
    path.write_text(t.to_str())
    return path


def reference_stream(tok_path, docs: list[str]) -> np.ndarray:
    """Each document encoded on its own, then the end-of-document id: what training must see."""
    t = load_tokenizer(tok_path)
    eos = eos_id(t)
    return np.concatenate([np.r_[t.encode(d, add_special_tokens=False).ids, eos] for d in docs])


def first_windows(ds, n: int) -> np.ndarray:
    return np.concatenate([ds.window(i)[:-1] for i in range(n)])


def test_parquet_folder_with_a_named_text_column(tmp_path, tok):
    docs = make_docs(30, 1)
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"id": list(range(20)), "body": docs[:20]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"id": list(range(10)), "body": docs[20:]}), folder / "part-1.parquet")
    data = load_data(
        str(folder), seq_len=16, vocab_size=None, default_vocab=0, tokenizer=str(tok), text_column="body"
    )
    ref = reference_stream(tok, docs[:20])  # the first shard's windows come first
    n = len(ref) // 16 - 1
    np.testing.assert_array_equal(first_windows(data.train, n), ref[: n * 16])
    assert data.vocab_size == load_tokenizer(tok).get_vocab_size()


def test_missing_text_column_names_the_columns(tmp_path, tok):
    pq.write_table(pa.table({"id": [1, 2], "content": ["a b", "c d"]}), tmp_path / "x.parquet")
    with pytest.raises(HydraDataError, match=r"no text column 'text'; the columns are id, content"):
        load_data(
            str(tmp_path / "x.parquet"), seq_len=4, vocab_size=None, default_vocab=0, tokenizer=str(tok)
        )
    with pytest.raises(HydraDataError, match="column 'id' holds int64, not text"):
        load_data(
            str(tmp_path / "x.parquet"),
            seq_len=4,
            vocab_size=None,
            default_vocab=0,
            tokenizer=str(tok),
            text_column="id",
        )


def test_arrow_ipc_file(tmp_path, tok):
    docs = make_docs(12, 2)
    table = pa.table({"text": docs})
    with pa.ipc.new_file(tmp_path / "d.arrow", table.schema) as w:
        w.write_table(table)
    data = load_data(
        str(tmp_path / "d.arrow"), seq_len=8, vocab_size=None, default_vocab=0, tokenizer=str(tok)
    )
    ref = reference_stream(tok, docs)
    np.testing.assert_array_equal(first_windows(data.train, 5), ref[:40])


def test_hf_dataset_dict_uses_its_validation_split(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    train_docs, val_docs = make_docs(20, 3), make_docs(6, 4)
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": train_docs}),
        validation=datasets.Dataset.from_dict({"text": val_docs}),
    )
    dd.save_to_disk(str(tmp_path / "hf"))
    data = load_data(str(tmp_path / "hf"), seq_len=8, vocab_size=None, default_vocab=0, tokenizer=str(tok))
    np.testing.assert_array_equal(first_windows(data.train, 4), reference_stream(tok, train_docs)[:32])
    np.testing.assert_array_equal(first_windows(data.val, 4), reference_stream(tok, val_docs)[:32])
    assert "Hugging Face dataset" in data.description and "validation split" in data.description


def test_hf_single_dataset_holds_out_its_tail_and_finds_tokenizer_beside(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    docs = make_docs(25, 5)
    datasets.Dataset.from_dict({"story": docs, "n": list(range(25))}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer.json").write_bytes(tok.read_bytes())  # found beside the data
    data = load_data(str(tmp_path / "hf"), seq_len=8, vocab_size=None, default_vocab=0, text_column="story")
    total = data.train.num_windows + data.val.num_windows
    assert total == (len(reference_stream(tok, docs)) - 1) // 8
    assert data.val.num_windows == max(1, round(total * 0.01))
    with pytest.raises(HydraDataError, match=r"no text column 'text'; the columns are story, n"):
        load_data(str(tmp_path / "hf"), seq_len=8, vocab_size=None, default_vocab=0)


def test_text_data_without_tokenizer_says_how_to_build_one(tmp_path):
    pq.write_table(pa.table({"text": ["a b c"]}), tmp_path / "x.parquet")
    with pytest.raises(HydraDataError, match="tokenizer train builds one"):
        load_data(str(tmp_path), seq_len=4, vocab_size=None, default_vocab=300)


@pytest.mark.parametrize("where", ["file", "folder"])
def test_unsupported_format_is_named_with_the_supported_list(tmp_path, where):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    target = tmp_path / "data.csv" if where == "file" else tmp_path
    with pytest.raises(HydraDataError) as info:
        load_data(str(target), seq_len=4, vocab_size=None, default_vocab=300)
    msg = str(info.value)
    assert "\n" not in msg and ".csv" in msg
    for fmt in (".bin", ".pt", ".jsonl", ".txt", ".parquet", ".arrow", "save_to_disk"):
        assert fmt in msg


def test_missing_pyarrow_gives_the_install_hint(tmp_path, tok, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(HydraDataError, match=r"pip install 'hydra-train\[parquet\]'"):
        load_data(
            str(tmp_path / "x.parquet"), seq_len=4, vocab_size=None, default_vocab=0, tokenizer=str(tok)
        )


def test_tokenizer_train_then_a_run_finds_it(tmp_path):
    from hydra_train.run import run_training
    from tests.hydra_train.conftest import tiny_config

    data = tmp_path / "mydata"
    data.mkdir()
    docs = make_docs(80, 6)
    pq.write_table(pa.table({"text": docs[:70]}), data / "train.parquet")
    (data / "notes.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[70:]))
    res = runner.invoke(app, ["tokenizer", "train", str(data), "--vocab_size", "360", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["tokenizer"] == str(data / "tokenizer.json") and out["documents"] == 80
    assert out["characters"] == sum(map(len, docs))
    tok = load_tokenizer(data / "tokenizer.json")
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() == out["vocab_size"] <= 360
    # the same command again refuses to overwrite it
    again = runner.invoke(app, ["tokenizer", "train", str(data), "--vocab_size", "360"])
    assert again.exit_code == 1 and "--force" in again.output

    cfg = tiny_config(
        data, tmp_path / "ck", vocab_size=None, seq_len=16, max_steps=2, eval_every=2, save_every=2
    )
    summary = run_training(cfg)
    assert summary["steps"] == 2
    assert f"vocab {tok.get_vocab_size()}" in summary["data"]
    assert (tmp_path / "ck" / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()


def test_tokenizer_train_reports_bad_input_in_one_line(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    res = runner.invoke(
        app, ["tokenizer", "train", str(tmp_path / "a.csv"), "--out", str(tmp_path / "t.json")]
    )
    assert res.exit_code == 1
    assert "unsupported data format '.csv'" in res.output and ".parquet" in res.output
    assert not (tmp_path / "t.json").exists()


def test_tokenizer_train_reads_the_training_part_only(tmp_path):
    """Validation text (a val/ folder, or val-named shards) does not shape the vocabulary."""
    from hydra_train.text_tables import iter_texts

    (tmp_path / "a" / "train").mkdir(parents=True)
    (tmp_path / "a" / "val").mkdir()
    (tmp_path / "a" / "train" / "x.txt").write_text("train text")
    (tmp_path / "a" / "val" / "y.txt").write_text("val text")
    assert list(iter_texts([tmp_path / "a"])) == ["train text"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "part-0.txt").write_text("one")
    (tmp_path / "b" / "part-1.jsonl").write_text('{"text": "two"}\n')
    (tmp_path / "b" / "data_val.txt").write_text("held out")
    assert list(iter_texts([tmp_path / "b"])) == ["one", "two"]
