"""hydra-train pretest end to end (CPU, tiny preset), and the SafeOptimizations flags on run."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hydra_train.cli import app

runner = CliRunner()
TINY = [
    "--model_size",
    "tiny",
    "--model_override",
    "dim=64",
    "--model-override",
    "max_seq_len=64",
    "--seq_len",
    "16",
    "--batch-size",
    "2",
    "--device",
    "cpu",
    "--cpu_threads",
    "1",
    "--pretest_warmup_steps",
    "1",
    "--pretest-steps",
    "2",
]


def test_pretest_json_history_and_report(tmp_path):
    logs = str(tmp_path / "logs")
    r = runner.invoke(
        app,
        [
            "pretest",
            *TINY,
            "--static-routing-mode",
            "--no-experimental_fa3",
            "--only",
            "static_routing,fa3",
            "--log_dir",
            logs,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["results"]["static_routing"]["status"] == "PASS" and "fa3" not in rec["results"]
    r = runner.invoke(app, ["pretest", "--history", "--log-dir", logs, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["tiny"]["static_routing"]["status"] == "PASS"
    out = tmp_path / "OPT.md"
    r = runner.invoke(
        app, ["pretest", "--report", str(out), "--log_dir", logs, "--speedup_model_size", "tiny"]
    )
    assert r.exit_code == 0 and "| static_routing | `--static_routing_mode` | PASS |" in out.read_text()


def test_pretest_errors(tmp_path):
    r = runner.invoke(app, ["pretest", "--only", "warp_drive"])
    assert r.exit_code == 2 and "unknown optimization 'warp_drive'" in r.output
    r = runner.invoke(app, ["pretest", "--report", str(tmp_path / "x.md"), "--log_dir", str(tmp_path)])
    assert r.exit_code == 1 and "no pretest records" in r.output


def test_run_takes_the_safe_opts_flags_in_both_spellings():
    import typer

    params = typer.main.get_command(app).commands["run"].params
    names = {n for p in params for n in (*p.opts, *p.secondary_opts)}
    for flag in (
        "experimental_fa3",
        "experimental_cuda_graphs",
        "experimental_blackwell_tuning",
        "experimental_fp8",
    ):
        kebab = flag.replace("_", "-")
        assert {f"--{flag}", f"--{kebab}", f"--no-{flag}", f"--no-{kebab}"} <= names, flag
    for flag in (
        "cuda_graphs_warmup",
        "fp8_format",
        "fp8_scaling",
        "compile_scope",
        "experimental_safety_window",
        "experimental_loss_spike_threshold",
        "experimental_throughput_drop_threshold",
        "experimental_skip_pretest",
        "triton_block_q",
        "triton_block_kv",
        "triton_num_warps",
    ):
        assert {f"--{flag}", "--" + flag.replace("_", "-")} <= names, flag
