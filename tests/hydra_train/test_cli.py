"""`hydra-train run` and `hydra-train db ...` end to end on the tiny preset."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from hydra_train.cli import app

from .conftest import TINY_OVERRIDES, VOCAB

runner = CliRunner()


def _run_args(data, ckpt, *extra: str) -> list[str]:
    # both spellings on purpose: the seed's underscores and Typer's kebab-case
    args = [
        "run",
        "--dataset",
        str(data),
        "--vocab_size",
        str(VOCAB),
        "--seq-len",
        "32",
        "--batch_size",
        "4",
        "--max-steps",
        "4",
        "--log_every",
        "2",
        "--eval-every",
        "2",
        "--eval_batches",
        "2",
        "--save-every",
        "2",
        "--keep_checkpoints",
        "1",
        "--checkpoint-dir",
        str(ckpt),
        "--device",
        "cpu",
        "--cpu-threads",
        "1",
        "--experimental-prefetch-threads",
        "2",
        "--prefetch_buffer_size",
        "3",
        "--model_size",
        "tiny",
        "--lr_schedule",
        "wsd",
    ]
    for k, v in TINY_OVERRIDES.items():
        args += ["--model_override", f"{k}={v}"]
    return args + list(extra)


def test_run_end_to_end_and_db_commands(bin_dataset, tmp_path):
    ck = tmp_path / "ck"
    res = runner.invoke(app, _run_args(bin_dataset, ck))
    assert res.exit_code == 0, res.output
    out = res.output
    assert "summary" in out and "validation loss" in out and "tokens/s" in out
    names = sorted(p.name for p in ck.iterdir())
    assert "hydra_tiny_final.pt" in names and "training.db" in names
    assert [n for n in names if n.startswith("hydra_tiny_step")] == ["hydra_tiny_step2.pt"]  # keep 1
    run_dir = next((ck / "runs").iterdir())
    for f in (
        "env.json",
        "dtypes_report.txt",
        "opt_state_mb.txt",
        "heartbeat_rank0.jsonl",
        "fallback_counters.csv",
    ):
        assert (run_dir / f).is_file(), f
    assert float((run_dir / "opt_state_mb.txt").read_text()) > 0
    fb = (run_dir / "fallback_counters.csv").read_text().splitlines()
    assert fb[0] == "step,time,source,name,count"
    assert (
        any(",kernel,rms_norm,0" in ln for ln in fb)
        and fb[-1].startswith("4,")
        and "total_fallbacks" in fb[-1]
    )
    assert len((run_dir / "heartbeat_rank0.jsonl").read_text().splitlines()) == 2

    # resume past the end: continues to the new max and says so
    res = runner.invoke(app, [*_run_args(bin_dataset, ck), "--resume", "--max_steps", "6"])
    assert res.exit_code == 0, res.output
    assert "resuming from" in res.output and "hydra_tiny_final.pt (step 4" in res.output

    stats = json.loads(runner.invoke(app, ["db", "stats", "--checkpoint_dir", str(ck), "--json"]).output)
    assert stats[0]["model_id"] == "tiny" and stats[0]["runs"] == 2 and stats[0]["last_step"] == 6
    runs = json.loads(runner.invoke(app, ["db", "runs", "--checkpoint-dir", str(ck), "--json"]).output)
    assert [r["status"] for r in runs] == ["finished", "finished"]
    assert runs[1]["resumed_from"] == runs[0]["run_id"] and runs[1]["start_step"] == 4
    ema = json.loads(
        runner.invoke(app, ["db", "ema", "--checkpoint_dir", str(ck), "--start", "4", "--json"]).output
    )
    assert [r["step"] for r in ema] == [4, 6]
    res = runner.invoke(app, ["db", "milestones", "--checkpoint_dir", str(ck)])
    assert res.exit_code == 0 and "milestones" in res.output
    res = runner.invoke(app, ["db", "rebuild", "--checkpoint_dir", str(ck), "--json"])
    assert res.exit_code == 0 and len(json.loads(res.output)["runs"]) == 2
    res = runner.invoke(app, ["db", "stats", "--checkpoint_dir", str(tmp_path / "none")])
    assert res.exit_code == 1 and "no metrics database" in res.output


def test_resume_with_another_model_config_is_refused(bin_dataset, tmp_path):
    ck = tmp_path / "ck"
    first = runner.invoke(app, _run_args(bin_dataset, ck, "--max_steps", "2"))
    assert first.exit_code == 0 and "torch.compile: off on the CPU" in first.output  # said, with why
    res = runner.invoke(app, [*_run_args(bin_dataset, ck), "--resume", "--model_override", "dim=96"])
    assert res.exit_code == 1
    assert "different model config" in res.output and "dim: 64 != 96" in res.output
    assert "--model_override dim=64" in res.output  # the flag that gives the saved model back
    assert "Traceback" not in res.output


def test_bad_data_is_one_line_and_exit_1(tmp_path):
    raw = tmp_path / "bad" / "train.bin"
    raw.parent.mkdir()
    ids = np.arange(4000, dtype=np.uint16) % 300
    ids[::31] = 5000  # in every window, so the first batch built (validation or training) hits one
    raw.write_bytes(ids.tobytes())
    (tmp_path / "bad" / "train.bin.json").write_text('{"dtype": "uint16"}')
    res = runner.invoke(app, _run_args(tmp_path / "bad", tmp_path / "ck"))
    assert res.exit_code == 1
    flat = " ".join(res.output.split())  # rich wraps at the test terminal's 80 columns
    assert flat.count("error:") == 1
    assert "train.bin: token id 5000" in flat and "outside the vocabulary" in flat
    assert "Traceback" not in res.output
    res = runner.invoke(app, _run_args(tmp_path / "missing", tmp_path / "ck"))
    assert res.exit_code == 1 and "not found" in " ".join(res.output.split())


def test_help_lists_both_spellings_and_bad_usage():
    import typer

    run_cmd = typer.main.get_command(app).commands["run"]
    for param in run_cmd.params:
        for opt in param.opts:
            if "_" in opt or "-" in opt[2:]:  # every multi-word option exists in both spellings
                assert (
                    opt.replace("_", "-") in param.opts and "--" + opt[2:].replace("-", "_") in param.opts
                ), opt
        assert param.help, param.name
    names = {o for p in run_cmd.params for o in p.opts}
    for flag in (
        "--max_steps",
        "--8bit_adam",
        "--checkpoint_every",
        "--chunked_ce",
        "--triton_kernels",
        "--static_routing_mode",
        "--experimental_prefetch_threads",
        "--fsdp",
        "--moe_num_experts",
        "--save_every",
        "--keep_checkpoints",
        "--compile",
        "--tensorboard",
        "--wandb",
        "--resume",
    ):
        assert flag in names, flag
    res = runner.invoke(app, ["run", "--help"], env={"TERMINAL_WIDTH": "240", "COLUMNS": "240"})
    assert res.exit_code == 0 and "--max-steps" in res.output and "--8bit_adam" in res.output
    res = runner.invoke(app, ["run", "--mode", "fast", "--max_steps", "1"])
    assert res.exit_code == 2 and "--mode 'fast' is not one of" in res.output  # a usage error


@pytest.mark.slow
def test_default_corpus_builds_and_caches_its_tokenizer(tmp_path, monkeypatch):
    """The main job's data path for real: stdlib corpus, BPE trained once, then loaded from the cache."""
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    args = [
        "run",
        "--max_steps",
        "2",
        "--batch_size",
        "2",
        "--seq_len",
        "64",
        "--eval_batches",
        "1",
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--device",
        "cpu",
        "--cpu_threads",
        "1",
        "--model_override",
        "dim=64",
    ]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "training a byte-level BPE tokenizer (vocab 4096)" in first.output
    tok = list((tmp_path / "cache" / "tokenizers").glob("stdlib-*-v4096.json"))
    assert len(tok) == 1 and len(list((tmp_path / "cache" / "corpora").glob("stdlib-*/*.bin"))) == 2
    second = runner.invoke(app, [*args, "--checkpoint_dir", str(tmp_path / "ck2")])
    assert second.exit_code == 0, second.output
    assert "tokenizer loaded from cache" in second.output and "training a byte-level" not in second.output
