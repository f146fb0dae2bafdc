"""hydra-train's help and tables as a new user reads them at 80 columns: defaults said for the
options that depend on the device, command descriptions wrapped as paragraphs (not at the source's
line breaks), `db runs` showing the losses its help names, pretest tables that never cut a name."""

from __future__ import annotations

import itertools

import pytest
from rich.console import Console
from typer.testing import CliRunner

from hydra_train.cli import app
from hydra_train.metrics_db import TrainingDB
from tests.help_rows import command_entry

runner = CliRunner()
W80 = {"COLUMNS": "80"}


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_run_help_says_the_automatic_defaults():
    from hydra_train.config_defaults import PRODUCTION_DEFAULTS, TESTING_DEFAULTS

    flat = _flat(runner.invoke(app, ["run", "--help"], env=W80).output)
    cpu, cuda = TESTING_DEFAULTS["cpu"], TESTING_DEFAULTS["cuda"]
    for name in ("batch_size", "seq_len"):
        assert f"default: {cpu[name]} on the CPU, {cuda[name]} on CUDA" in flat, name
    for name in ("max_steps", "eval_every", "log_every", "save_every"):
        want = f"default: testing mode {cpu[name]} on the CPU, {cuda[name]} on CUDA; production"
        assert f"{want} {PRODUCTION_DEFAULTS[name]}" in flat, name
    assert "0: only the final checkpoint" in flat
    assert f"auto: {cpu['dataset']} on the CPU, {cuda['dataset']} on CUDA" in flat


@pytest.mark.parametrize(
    ("args", "command"),
    [([], "run"), ([], "pretest"), (["db"], "runs"), (["tokenizer"], "train")],
)
def test_command_lists_are_not_broken_at_source_line_ends(args, command):
    rows = command_entry(runner.invoke(app, [*args, "--help"], env=W80).output, command)
    # a source line break ended a line early: every line but the entry's last is filled
    assert all(len(r) >= 55 for r in rows[:-1]), "\n".join(rows)


@pytest.mark.parametrize("command", [["run"], ["pretest"], ["db", "runs"], ["tokenizer", "train"]])
def test_a_commands_own_description_is_wrapped_as_paragraphs(command):
    out = runner.invoke(app, [*command, "--help"], env=W80).output
    head = out[: out.index("╭")]
    lines = [line.rstrip() for line in head.splitlines()[3:]]
    # inside a paragraph, a line ends short only where the paragraph ends (a blank line follows)
    for line, after in itertools.pairwise(lines):
        if line.strip() and after.strip():
            assert len(line) >= 60, f"ragged: {line!r} / {after!r}"


def _db_with_a_run(folder):
    with TrainingDB(folder / "training.db") as db:
        db.upsert_model("tiny", "tiny", 10, 8, {})
        db.start_run("tiny_20260101-000000_abcdef", "tiny", 0, {})
        db.finish_run(
            "tiny_20260101-000000_abcdef", "finished", best_loss=2.5, best_val_loss=3.25, final_val_loss=3.5
        )


def test_db_runs_shows_the_losses_its_help_names(tmp_path):
    _db_with_a_run(tmp_path)
    for width in ("80", "400"):
        res = runner.invoke(app, ["db", "runs", "--checkpoint_dir", str(tmp_path)], env={"COLUMNS": width})
        assert res.exit_code == 0, res.output
        flat = _flat(res.output)
        assert "best_val_loss" in flat and "3.25" in flat, width
        assert "best_train_loss" in flat and "2.5" in flat and "final_val_loss" in flat, width
        assert "…" not in res.output
        assert all(len(line) <= int(width) for line in res.output.splitlines())
    help_text = _flat(runner.invoke(app, ["db", "runs", "--help"], env=W80).output)
    assert "best training loss, best and final validation loss" in help_text


def test_pretest_history_at_80_columns_cuts_no_name_or_date(tmp_path):
    from hydra_train.safe_opts.pretest_log import PretestHook

    hook = PretestHook(tmp_path)
    rec = {
        "model_size": "100M",
        "fingerprint": "f",
        "time": "2026-01-10T10:00:00+00:00",
        "env": {"device": "NVIDIA H100 80GB HBM3"},
        "results": {
            "cuda_graphs": {"status": "PASS", "reason": None, "timing": {"speedup": 1.4}},
            "prefetch_threads": {"status": "FAIL", "reason": "slower [by 3%]", "timing": {"speedup": 0.97}},
        },
    }
    hook.record(rec)
    con = Console(record=True, width=80)
    hook.print_summary(con)
    text = con.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for whole in ("cuda_graphs", "prefetch_threads", "2026-01-10T10:00:00+00:00", "slower [by 3%]"):
        assert whole in text, whole


def test_pretest_record_at_80_columns_cuts_no_name(monkeypatch):
    import hydra_train.cli_pretest as cli_pretest

    con = Console(record=True, width=80)
    monkeypatch.setattr(cli_pretest, "console", con)
    results = {
        name: {
            "status": "PASS",
            "reason": None,
            "timing": {"median_ms": 12.5, "default_median_ms": 14.0, "speedup": 1.12},
            "numerics": {"grad_err": 1e-3, "grad_bound": 1e-2},
        }
        for name in ("cuda_graphs", "prefetch_threads", "experimental_fa3")
    }
    rec = {"model_size": "tiny", "env": {"device": "cpu"}, "batch": [8, 128], "precision": "fp32"}
    cli_pretest._show({**rec, "results": results, "log_file": "x.json", "wall_s": 3})
    text = con.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for name in results:
        assert name in text, name
