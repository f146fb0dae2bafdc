"""``hydra-diag race``: named configurations trained for the same wall-clock budget, compared."""

from pathlib import Path
from typing import Annotated

import typer

from hydra_diag.cliutil import Device, opt, run_guarded
from hydra_kernels.cli_support import console, new_app

app = new_app(
    "Equal-wall-clock race: which model reaches a lower validation loss in the same training time?"
    "\n\n[bold]What it measures.[/] Each named configuration (`hydra-diag race configs` lists them: "
    "the dense GPT, HYDRA and its ablations) trains for the same budget of seconds; validation "
    "cross-entropy is measured at evenly spaced training times. Table: parameters, executed GFLOP "
    "per token (forward + backward), tokens/s, setup seconds, tokens seen, epochs over the training "
    "split, validation loss at each evaluation time, the final loss with training-mode routing "
    "(routed models). PNGs: validation loss against training time, tokens seen and executed FLOPs."
    "\n\n[bold]Fairness rules.[/] The same tokens in the same order for every configuration (one "
    "seeded stream of [B, T] windows from the training split); the same fixed validation windows; "
    "the same optimizer (AdamW 0.9/0.95, weight decay 0.1 on matrices, grad clip 1, fused on CUDA); "
    "the same loss (on CUDA the fused chunked linear + cross-entropy, hydra-train's default there); "
    "the same peak LR (a per-configuration override is allowed) on a schedule of TRAINING SECONDS "
    "(linear warmup over the first 5% of the budget, cosine to 10% at its end). Setup (build, "
    "compile, warm-up steps, then the initial weights restored) is reported apart and not counted; "
    "the clock stops during evaluations. Evaluation uses inference-mode routing (what generation "
    "uses); bf16 autocast on CUDA, fp32 eager on the CPU."
    "\n\n[bold]Data.[/] By default the pyenv corpus: every .py of this interpreter's standard library "
    "and installed packages (--extensions adds other source types), tokenized once with a 32K "
    "byte-level BPE and cached under HYDRA_CACHE_DIR (default ~/.cache/hydra). A configuration that "
    "goes over the training split more than once is flagged in the table."
    "\n\n[bold]Example (GPU):[/] hydra-diag race run --configs all --model-size 100M --budget 120 "
    "--json out/race.json --plots out"
    "\n\nRuns made separately merge into one table and one set of plots: hydra-diag race merge "
    "gpt.json hydra.json --json all.json --plots out"
)

JsonPath = Annotated[
    str | None, opt("--json", help="Write the whole result as JSON to this file ('-': stdout, no table).")
]
PlotsDir = Annotated[
    Path | None, opt("--plots", help="Write race_loss_vs_{time,tokens,flops}.png into this folder.")
]


def _finish(doc, json_path: str | None, plots: Path | None) -> None:
    from hydra_diag.race.plots import plot_race
    from hydra_diag.race.render import render_race
    from hydra_diag.race.results import write_document

    if json_path not in (None, "-"):
        write_document(doc, json_path)  # first: a failing plot must not lose the measurements
    if plots is not None:
        doc["plots"] = [str(p) for p in plot_race(doc, plots)]
    if json_path is not None:
        write_document(doc, json_path)
    if json_path != "-":
        render_race(doc, console)
        for p in doc.get("plots", []):
            console.print(f"plot: {p}", highlight=False)
        if json_path:
            console.print(f"json: {json_path}", highlight=False)
    failed = [r["name"] for r in doc["runs"] if r.get("status") != "ok"]
    if failed:
        from hydra_kernels.cli_support import fail

        reasons = "; ".join(
            f"{r['name']}: {r.get('error') or r.get('status')}" for r in doc["runs"] if r["name"] in failed
        )
        # Ctrl-C exits 130 as hydra-train run's does (scripts tell an interrupt from a failure)
        interrupted = any(r.get("status") == "interrupted" for r in doc["runs"])
        fail(
            f"race: {len(failed)} configuration(s) did not finish cleanly ({reasons})",
            130 if interrupted else 1,
        )


@app.command("run")
def run_cmd(
    configs: Annotated[
        str | None,
        opt("--configs", help="Comma-separated configuration names, or 'all' (default gpt,hydra)."),
    ] = None,
    model_size: Annotated[
        str,
        opt(
            "--model_size",
            help="Preset of every configuration: tiny, debug, 100M ... (hydra-v1, hydra-v2 and "
            "hydra-c3 are the 100M presets of earlier races: their dimensions stay 100M's).",
        ),
    ] = "100M",
    budget: Annotated[float, opt("--budget", help="Seconds of training per configuration.", min=0.1)] = 120.0,
    sets: Annotated[
        list[str] | None,
        opt(
            "--set",
            help="CONFIG.FIELD=VALUE (repeatable; CONFIG a name or a wildcard such as * or hydra*): a "
            "model-config field (hydra.mod_capacity=0.125, '*.use_chunked_ce=true'), or the race's own "
            "lr or compile (graphs, model, blocks, none) for those configurations. A later --set wins.",
        ),
    ] = None,
    lr: Annotated[float, opt("--lr", help="Peak learning rate of every configuration.", min=0.0)] = 6e-4,
    seq_len: Annotated[
        int, opt("--seq_len", help="Tokens per training window (T); row shards fix their own.", min=2)
    ] = 2048,
    batch_size: Annotated[int, opt("--batch_size", help="Windows per step (B).", min=1)] = 8,
    evals: Annotated[int, opt("--evals", help="Evaluations, evenly spaced in training time.", min=1)] = 6,
    val_windows: Annotated[
        int, opt("--val_windows", help="Validation windows (fixed, the same for all).", min=1)
    ] = 64,
    warmup: Annotated[float, opt("--warmup", help="Warmup share of the budget.", min=0.0, max=0.5)] = 0.05,
    min_lr_ratio: Annotated[
        float, opt("--min_lr_ratio", help="LR at the end / peak LR.", min=0.0, max=1.0)
    ] = 0.1,
    warmup_steps: Annotated[
        int | None,
        opt(
            "--warmup_steps",
            help="Untimed steps that compile before the clock starts (default 3 CUDA, 1 CPU).",
            min=0,
        ),
    ] = None,
    no_compile: Annotated[bool, opt("--no_compile", help="Eager on CUDA too (CPU is always eager).")] = False,
    compile_scope: Annotated[
        str,
        opt(
            "--compile_scope",
            help="graphs (torch.compile the whole model, replayed as CUDA graphs), model (compiled, "
            "no graphs) or blocks (each block compiled).",
        ),
    ] = "graphs",
    dataset: Annotated[
        str, opt("--dataset", help="pyenv, or any hydra-train --dataset (shard folder ...).")
    ] = "pyenv",
    extensions: Annotated[
        str | None,
        opt("--extensions", help="pyenv: file types to include, e.g. py,pyi,c,h,cpp,cu,md,rst (default py)."),
    ] = None,
    corpus_roots: Annotated[
        list[Path] | None,
        opt(
            "--corpus_root",
            help="pyenv: build from this source tree instead of the interpreter's (repeatable; the "
            "word env adds the interpreter's own folders).",
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        opt(
            "--vocab_size",
            help="pyenv: BPE vocabulary (at least 300; default 32000). Other datasets: default their "
            "tokenizer's or meta's vocabulary (32000 where they name none).",
            min=2,
        ),
    ] = None,
    device: Device = "auto",
    seed: Annotated[int, opt("--seed", help="Data order and initialisation seed.")] = 1337,
    log_every: Annotated[float, opt("--log_every", help="Seconds between progress lines.", min=0.1)] = 10.0,
    json_path: JsonPath = None,
    plots: PlotsDir = None,
    quiet: Annotated[bool, opt("--quiet", help="No progress on stderr.")] = False,
) -> None:
    """Race the configurations: each trains for --budget seconds on the same data; prints the table,
    writes --json (after each configuration too, so a killed race keeps those that finished) and
    --plots. Exit 1 when a configuration failed or diverged (the others still ran).
    Exit 130 when the race was interrupted (Ctrl-C: the configurations that finished are still written)."""
    from hydra_diag.race.configs import (
        COMPILE_CHOICES,
        check_buildable,
        parse_config_names,
        parse_sets,
        resolve_configs,
    )
    from hydra_diag.race.data import check_vocab_size, load_race_data
    from hydra_diag.race.loop import RaceSettings
    from hydra_diag.race.progress import RaceProgress
    from hydra_diag.race.runner import resolve_device, run_race

    if compile_scope not in COMPILE_CHOICES[:3]:
        raise typer.BadParameter(
            f"{compile_scope!r}: use graphs, model or blocks", param_hint="--compile-scope"
        )

    def go():
        dev = resolve_device(device)
        names = parse_config_names(configs)
        cfgs = resolve_configs(names, parse_sets(sets), lr=lr, compile_default=compile_scope)
        # what the flags' values alone decide, before the corpus (minutes to build the first time):
        # the vocabulary, the preset and every --set (run_race checks again with the data's vocabulary)
        vocab = check_vocab_size(dataset, vocab_size)
        check_buildable(cfgs, model_size, {"vocab_size": vocab} if vocab else {})
        settings = RaceSettings(
            model_size=model_size,
            budget_s=budget,
            evals=evals,
            warmup_frac=warmup,
            min_lr_ratio=min_lr_ratio,
            warmup_steps=warmup_steps if warmup_steps is not None else (3 if dev.type == "cuda" else 1),
            seed=seed,
            compile=not no_compile,
            log_every_s=log_every,
        )
        with RaceProgress(names, budget, enabled=not quiet) as prog:
            data = load_race_data(
                dataset,
                seq_len=seq_len,
                batch_size=batch_size,
                seed=seed,
                val_windows=val_windows,
                vocab_size=vocab_size,
                extensions=extensions,
                corpus_roots=corpus_roots,
                progress=prog.say,
            )
            prog.say(data.summary["description"])
            extra = {"val_windows": val_windows, "lr": lr, "dataset": dataset, "device_type": dev.type}
            from hydra_diag.race.results import write_document

            def save(doc) -> None:  # each finished entrant on disk at once: a killed race keeps them
                write_document(doc, json_path)

            keep = save if json_path not in (None, "-") else None
            return run_race(cfgs, data, settings, dev, prog, extra, on_entrant=keep)

    doc = run_guarded(go)
    _finish(doc, json_path, plots)


@app.command("merge")
def merge_cmd(
    files: Annotated[
        list[Path], typer.Argument(metavar="FILE", help="Race JSON files (hydra-diag race run --json).")
    ],
    json_path: JsonPath = None,
    plots: PlotsDir = None,
) -> None:
    """Merge races run separately (e.g. one configuration per process) into one table, JSON and set
    of plots. Refused, naming the field, when the runs differ in data (training tokens included),
    sequence length, batch size, budget, evaluation points, schedule or device, or when a
    configuration appears twice. A file written before races recorded their training data's digest
    is merged with a warning that its training data could not be checked."""
    from hydra_diag.race.results import load_document, merge_documents
    from hydra_kernels.cli_support import err_console

    def warn(message: str) -> None:
        err_console.print(message, highlight=False, markup=False)

    doc = run_guarded(lambda: merge_documents([(str(f), load_document(f)) for f in files], warn))
    _finish(doc, json_path, plots)


@app.command("configs")
def configs_cmd() -> None:
    """The named configurations: architecture, model overrides, what each is."""
    from rich.table import Table

    from hydra_diag.race.configs import DEFAULT_CONFIGS, RACE_CONFIGS

    t = Table(title="race configurations (default: " + ",".join(DEFAULT_CONFIGS) + ")", title_justify="left")
    for col in ("name", "arch", "overrides", "what"):
        t.add_column(col)
    for name, (arch, over, desc) in RACE_CONFIGS.items():
        t.add_row(name, arch, ", ".join(f"{k}={v}" for k, v in over.items()) or "-", desc)
    console.print(t)


@app.command("corpus")
def corpus_cmd(
    extensions: Annotated[
        str | None, opt("--extensions", help="File types, e.g. py,pyi,c,md (default py).")
    ] = None,
    corpus_roots: Annotated[
        list[Path] | None,
        opt(
            "--corpus_root",
            help="Build from this source tree instead of the interpreter's (repeatable; the word env "
            "adds the interpreter's own folders).",
        ),
    ] = None,
    vocab_size: Annotated[int, opt("--vocab_size", help="BPE vocabulary.", min=300)] = 32000,
    seq_len: Annotated[
        int, opt("--seq_len", help="Window length, to report windows and epochs.", min=2)
    ] = 2048,
    tokens_per_s: Annotated[
        float,
        opt("--tokens_per_s", help="Throughput to translate the training split into race seconds.", min=1.0),
    ] = 470_000.0,
) -> None:
    """Build (or load from the cache) the pyenv corpus and print its size: files, MB, tokens, the
    train/validation split, and how many seconds of racing at --tokens-per-s one epoch lasts."""
    from hydra_diag.race.data import load_race_data
    from hydra_kernels.cli_support import err_console

    data = run_guarded(
        lambda: load_race_data(
            "pyenv",
            seq_len=seq_len,
            batch_size=1,
            seed=0,
            val_windows=1,
            vocab_size=vocab_size,
            extensions=extensions,
            corpus_roots=corpus_roots,
            progress=lambda m: err_console.print(m, highlight=False, markup=False),
        )
    )
    s = data.summary
    console.print(s["description"], highlight=False, markup=False)
    console.print(f"cache: {s['folder']}", highlight=False, markup=False)
    console.print(
        f"one epoch of the training split = {data.train_tokens / tokens_per_s:.0f} s of racing at "
        f"{tokens_per_s / 1e3:.0f}K tokens/s",
        highlight=False,
    )
