"""Shared fixtures for the hydra-diag tests: one small MoE training run made with hydra-train's own
library (once per session), a tiny model config, and helpers to run the CLI and check outputs."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hydra_kernels

#: The tiny preset narrowed so a CPU step takes milliseconds; three blocks so the middle one is
#: MoD-routed (first and last are dense by default).
TINY = {"dim": 64, "n_mor_blocks": 3, "max_seq_len": 64}
VOCAB = 320
TINY_SET = [
    "--set",
    "dim=64",
    "--set",
    "n_mor_blocks=3",
    "--set",
    "max_seq_len=64",
    "--set",
    f"vocab_size={VOCAB}",
]


def _one_thread_reference_kernels():
    # one intra-op thread (the shared 2-core machine), PyTorch references (the interpreter is slow)
    hydra_kernels.set_use_triton_kernels(False)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _frugal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default outputs (<tool>.png, traces) land in the test's folder
    was, threads = hydra_kernels.use_triton_kernels(), torch.get_num_threads()
    _one_thread_reference_kernels()
    try:
        yield
    finally:
        hydra_kernels.set_use_triton_kernels(was)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> types.SimpleNamespace:
    """A 16-step MoE run of the narrowed tiny preset on a learnable bigram stream: checkpoints at
    steps 4, 8, 12 and the final one, training.db, the diagnostics export."""
    from hydra_diag.synthetic import write_bigram_dataset
    from hydra_train.config import TrainConfig
    from hydra_train.run import run_training

    _one_thread_reference_kernels()
    root = tmp_path_factory.mktemp("tiny_run")
    data = write_bigram_dataset(root / "data", VOCAB, 8000, 3000, seed=0)
    cfg = TrainConfig(
        model_size="tiny",
        dataset=str(data),
        vocab_size=VOCAB,
        seq_len=32,
        batch_size=4,
        max_steps=16,
        log_every=2,
        eval_every=8,
        eval_batches=2,
        save_every=4,
        keep_checkpoints=0,
        checkpoint_dir=str(root / "ckpt"),
        device="cpu",
        cpu_threads=1,
        experimental_prefetch_threads=0,
        progress=False,
        lr=3e-3,
        warmup_steps=2,
        moe=True,
        model_overrides=dict(TINY),
        # real step times on a shared 2-core machine swing enough to trip the default 0.5 throughput
        # detector now and then (seen once: an anomaly at step 14 under the parallel suite); a step
        # 100x slower than its EMA still counts, so the dashboard test's "no anomaly" stays a check
        experimental_throughput_drop_threshold=0.01,
    )
    from rich.console import Console

    summary = run_training(cfg, console=Console(quiet=True))
    folder = Path(cfg.checkpoint_dir)
    return types.SimpleNamespace(
        folder=folder, data=data, summary=summary, final=folder / "hydra_tiny_final.pt"
    )


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, args: list[str]):
    from hydra_diag.cli import app

    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def run_json(runner: CliRunner, args: list[str], code: int = 0) -> dict:
    """Invoke ``hydra-diag ARGS --json`` and return the parsed stdout (asserting the exit code)."""
    res = invoke(runner, [*args, "--json"])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


def assert_png(path: str | Path) -> None:
    """A readable PNG image of a plausible size."""
    from PIL import Image

    p = Path(path)
    assert p.is_file(), f"{p} was not written"
    with Image.open(p) as im:
        im.verify()
    with Image.open(p) as im:
        assert im.format == "PNG"
        w, h = im.size
        assert w >= 200 and h >= 150


def one_line_error(res, *needles: str) -> None:
    """Exit status 1 and exactly one non-empty line on stderr containing every needle."""
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def last_error_line(res) -> str:
    """The last non-empty stderr line (progress lines may come before the error)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines, res.output
    return lines[-1]


def synthetic_db(
    folder: Path,
    steps: list[dict],
    *,
    status: str = "finished",
    moe_rows: list[dict] | None = None,
    train_config: dict | None = None,
    model_config: dict | None = None,
) -> Path:
    """A training.db written through hydra-train's TrainingDB with the given step rows (each a dict
    of ``log_step`` values plus ``step``; ``lr_phase``/``base_lr`` go to adaptive_lr) and MoE rows."""
    from hydra_model import preset_config
    from hydra_train.metrics_db import DB_NAME, TrainingDB

    cfg = model_config or preset_config("tiny", **TINY, vocab_size=VOCAB, moe_enabled=True).to_dict()
    with TrainingDB(folder / DB_NAME) as db:
        db.upsert_model("tiny", "tiny", 1000, 900, cfg)
        db.start_run(
            "run1", "tiny", 0, train_config or {"warmup_steps": 2, "max_steps": 100, "grad_clip": 1.0}
        )
        for row in steps:
            row = dict(row)
            step = row.pop("step")
            phase, base = row.pop("lr_phase", "cosine"), row.pop("base_lr", 1e-3)
            db.log_step("run1", step, **row)
            db.log_lr("run1", step, row.get("lr", 1e-3), base, phase)
        for m in moe_rows or []:
            db.log_routing("run1", m["step"], {"moe": [m]})
        if status != "running":
            db.finish_run("run1", status)
        db.commit()
    return folder
