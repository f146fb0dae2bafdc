"""The `hydra-train` command line: `run` (train), `pretest` (SafeOptimizations' pretests alone, their
history and OPTIMIZATIONS.md, cli_pretest), the `db` group (query the metrics database, cli_db) and
`tokenizer train` (a BPE for the user's own text, cli_tokenizer).

`run` and `pretest` take the configuration's options (cli_options.config_command: each field of
hydra_train.config_options is one option, parsed once into a TrainConfig). Every option accepts the
seed documents' underscore spelling and Typer's kebab-case (``--max_steps`` and ``--max-steps``).
Nothing heavy is imported until a command runs.
"""

from typing import Annotated

from hydra_kernels.cli_support import add_version_option, console, emit_json, err_console, new_app, reflowed
from hydra_kernels.cli_support import opt as _opt
from hydra_train import __version__
from hydra_train.cli_options import Debug, config_command
from hydra_train.config import TrainConfig

app = new_app("Train HYDRA models: hydra-train run, pretests, metrics database.")
add_version_option(app, "hydra-train", __version__)

#: Help text of the options only `run` takes beside the configuration's.
H = {
    "json_out": "Print the final summary as JSON instead of a table.",
    "dry_run": "Print the resolved configuration and the optimizations that would be pretested, then "
    "exit (no data, no model); --device cuda works without a GPU.",
}


@app.command("run")
@reflowed
@config_command("run")
def run(
    cfg: TrainConfig,
    json_out: Annotated[bool, _opt("--json", help=H["json_out"])] = False,
    debug: Debug = False,
    dry_run: Annotated[bool, _opt("--dry_run", help=H["dry_run"])] = False,
) -> None:
    """Train a HYDRA model.

    With no options: the tiny preset on the Python standard library's own source (tokenizer built
    and cached on first use), a few minutes on a laptop CPU; on a GPU a larger preset with bf16
    autocast. Checkpoints, training.db and run artifacts go to --checkpoint_dir.

    Multi-GPU: torchrun --nproc_per_node=N -m hydra_train run ... (DDP; --fsdp for FSDP2)."""
    from hydra_train.cli_errors import resume_hint, run_guarded
    from hydra_train.run import run_training, summary_rows

    cfg = cfg.replace(progress=not json_out)
    if dry_run:
        _print_dry_run(run_guarded(lambda: _dry_run(cfg), debug=debug, resume_hint=""), json_out)
        return
    summary = run_guarded(
        lambda: run_training(cfg, console=err_console if json_out else console),
        debug=debug,
        resume_hint=lambda: resume_hint(cfg),  # this run's own flags (resume refuses others)
    )
    from hydra_train.options import torchrun_launch

    launch = torchrun_launch()
    if launch.rank == 0:
        if json_out:
            emit_json(summary)
        else:
            _print_summary(summary_rows(summary))
    if launch.world_size > 1:
        _leave_rank()


def _print_summary(rows) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="hydra-train run: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # long paths wrap whole at 80 columns, never cut
    for k, v in rows:
        table.add_row(k, Text(v))  # literal: a path with "[...]" is not markup
    console.print(table)


def _leave_rank() -> None:
    """End a torchrun rank whose run finished, skipping the interpreter's teardown. On gloo, a
    rank of a finished FSDP2 run sometimes aborted while the process was exiting ("terminate
    called without an active exception" from a C++ thread, then a segfault; about 1 in 20 loaded
    CPU runs, once in CI), after everything was saved and the process group destroyed. By here
    the checkpoints, database and summaries are written and closed; only the output streams are
    left to flush."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _dry_run(cfg):
    from hydra_train.dry_run import dry_run

    return dry_run(cfg)


def _print_dry_run(report: dict, json_out: bool) -> None:
    if json_out:
        emit_json(report)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"hydra-train run --dry_run ({report['device_note']})", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for k, v in report["fast_path"].items():
        table.add_row(k, Text(str(v)))
    table.add_row("compile because", Text(report["compile_reason"]))
    table.add_row("requested (pretested where they apply)", Text(", ".join(report["would_pretest"]) or "-"))
    for k in ("arch", "model_size", "batch_size", "seq_len", "max_steps", "lr", "dataset"):
        table.add_row(k, Text(str(report["config"].get(k))))
    console.print(table)


from hydra_train.cli_db import db_app  # noqa: E402  (defined beside, registered here)

app.add_typer(db_app, name="db")

from hydra_train.cli_pretest import pretest  # noqa: E402  (defined beside, registered here)

app.command("pretest")(pretest)

from hydra_train.cli_tokenizer import tokenizer_app  # noqa: E402

app.add_typer(tokenizer_app, name="tokenizer")
