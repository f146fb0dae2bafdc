"""``hydra-diag convert``: text and chat JSONL to token shards; shards regrouped by length."""

from typing import Annotated

import typer

from hydra_diag.cliutil import JsonOut, execute, one_of, opt, within
from hydra_kernels.cli_support import new_app

app = new_app("Data converters: JSONL text or chat → .pt token shards; shards grouped by sequence length.")

Inputs = Annotated[list[str], typer.Argument(metavar="INPUT", help="JSONL files, or folders of them.")]
OutDir = Annotated[str, opt("--out_dir", "--out", help="Folder to write the shards into.")]
Tokenizer = Annotated[
    str | None, opt("--tokenizer", help="A tokenizer.json (default: hydra-train's BPE, built on first use).")
]
VocabSize = Annotated[
    int, opt("--vocab_size", help="Vocabulary of hydra-train's default tokenizer.", min=300)
]
Layout = Annotated[
    str,
    opt(
        "--layout",
        help="stream ({'tokens': 1-D}) or rows ({'input_ids': [N, seq_len+1]}).",
        **one_of("stream", "rows"),
    ),
]
SeqLen = Annotated[int, opt("--seq_len", help="Row length − 1 for --layout rows.", min=1)]
PerShard = Annotated[int, opt("--tokens_per_shard", help="Tokens per output shard.", min=1)]
ValFraction = Annotated[
    float,
    opt("--val_fraction", **within("Share of documents for val/ (by content hash).", 0, 1, hi_open=True)),
]


@app.command("jsonl-to-pt")
def jsonl_to_pt_cmd(
    inputs: Inputs,
    out_dir: OutDir,
    tokenizer: Tokenizer = None,
    vocab_size: VocabSize = 4096,
    text_field: Annotated[str, opt("--text_field", help="The JSON field holding the text.")] = "text",
    layout: Layout = "stream",
    seq_len: SeqLen = 2048,
    tokens_per_shard: PerShard = 16_000_000,
    val_fraction: ValFraction = 0.0,
    json_out: JsonOut = False,
) -> None:
    """Tokenizes text JSONL (one {"text": ...} per line, e.g. Nemotron-style dumps) into .pt shards
    hydra-train reads with --dataset OUT_DIR; the tokenizer.json and a meta.json go beside them.
    Converting into OUT_DIR again replaces the earlier shards; other data there is refused, and a
    failed conversion leaves OUT_DIR as it was. Needs the `tokenizers` package (a hydra-train
    dependency); no GPU."""
    from hydra_diag.convert import jsonl_to_pt, render_convert

    execute(
        "jsonl-to-pt",
        lambda say: jsonl_to_pt(
            inputs,
            out_dir,
            text_field,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            layout=layout,
            seq_len=seq_len,
            tokens_per_shard=tokens_per_shard,
            val_fraction=val_fraction,
            progress=say,
        ),
        json_out,
        render_convert,
    )


@app.command("chat-to-pt")
def chat_to_pt_cmd(
    inputs: Inputs,
    out_dir: OutDir,
    tokenizer: Tokenizer = None,
    vocab_size: VocabSize = 4096,
    layout: Layout = "stream",
    seq_len: SeqLen = 2048,
    tokens_per_shard: PerShard = 16_000_000,
    val_fraction: ValFraction = 0.0,
    json_out: JsonOut = False,
) -> None:
    """Renders chat JSONL ({"messages": [{"role", "content"}...]} or ShareGPT {"conversations": [{"from",
    "value"}...]}) with the template "<|ROLE|>\\n" + content + "\\n" per message (roles system, user,
    assistant, tool), one conversation per document, and tokenizes it into .pt shards (OUT_DIR as for
    jsonl-to-pt). No GPU."""
    from hydra_diag.convert import chat_to_pt, render_convert

    execute(
        "chat-to-pt",
        lambda say: chat_to_pt(
            inputs,
            out_dir,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            layout=layout,
            seq_len=seq_len,
            tokens_per_shard=tokens_per_shard,
            val_fraction=val_fraction,
            progress=say,
        ),
        json_out,
        render_convert,
    )


@app.command("collect-by-seq")
def collect_by_seq_cmd(
    inputs: Annotated[list[str], typer.Argument(metavar="SHARD", help=".pt shards, or folders of them.")],
    out_dir: OutDir,
    rows_per_shard: Annotated[int, opt("--rows_per_shard", help="Rows per output shard.", min=1)] = 8192,
    json_out: JsonOut = False,
) -> None:
    """Regroups .pt shards by sequence length: row shards ({"input_ids": [N, L]}) go to OUT/seq_<L−1>/
    (one folder per length, each trainable with hydra-train --dataset), stream shards to OUT/stream/;
    writes OUT/manifest.json. No GPU."""
    from hydra_diag.collect_by_seq import collect_by_seq, render_collect

    execute(
        "collect-by-seq",
        lambda say: collect_by_seq(inputs, out_dir, rows_per_shard, progress=say),
        json_out,
        render_collect,
    )
