"""Issue 17, in-process part: a diverging run stops as ``failed`` and saves no non-finite weights,
checkpoints are verified on load, a refused resume changes no file, one run per folder, dead runs
are settled (``killed``, no duplicate step rows, no stale ``*.tmp``).

Tiny preset, a few CPU steps each; the expected outcome is stated independently of the code under
test (a flipped byte must be found, the folder's bytes before and after a refusal must be equal).
"""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hydra_train.checkpoint import list_checkpoints, load_checkpoint
from hydra_train.errors import HydraCheckpointError, HydraDivergedError, HydraTrainError
from hydra_train.run import run_training
from hydra_train.run_lock import LOCK_NAME
from hydra_train.safe_opts.callback import SafeOptimizations
from hydra_train.safe_opts.faults import FaultInjector

from .conftest import tiny_config


def _statuses(ckpt: Path) -> list[str]:
    with sqlite3.connect(ckpt / "training.db") as c:
        return [r[0] for r in c.execute("SELECT status FROM runs ORDER BY started_at")]


def _folder_bytes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _all_finite(path: Path) -> bool:
    ck = torch.load(path, weights_only=True)
    return all(torch.isfinite(t).all() for t in ck["model"].values() if t.is_floating_point())


@pytest.mark.parametrize(
    ("limit", "save_every", "why"),
    [(3, 0, r"steps in a row \(\d+-\d+\)"), (1000, 2, r"weights are not finite at step \d+")],
)
def test_huge_lr_stops_failed_and_saves_no_nonfinite_weights(bin_dataset, tmp_path, limit, save_every, why):
    # no saves: the skip limit stops it; limit 1000: the check of the weights before a save does
    cfg = tiny_config(
        bin_dataset,
        tmp_path,
        lr=1e38,
        max_steps=12,
        save_every=save_every,
        log_every=1,
        max_skipped_steps=limit,
    )
    with pytest.raises(HydraDivergedError, match=why):
        run_training(cfg)
    assert _statuses(tmp_path) == ["failed"]
    for p in list_checkpoints(tmp_path):
        assert _all_finite(p), p


def test_nan_gradients_every_step_stop_after_the_skip_limit(bin_dataset, tmp_path):
    cfg = tiny_config(
        bin_dataset, tmp_path, max_steps=12, max_skipped_steps=2, experimental_prefetch_threads=1
    )
    inj = FaultInjector.parse("nan_grad:prefetch_threads@always")
    safe = SafeOptimizations(cfg, fault_injector=inj, log=lambda m: None)
    with pytest.raises(HydraDivergedError, match=r"3 steps in a row \(1-3\)"):
        run_training(cfg, callbacks=[safe])
    assert _statuses(tmp_path) == ["failed"]
    assert list_checkpoints(tmp_path) == []  # the weights never changed, but the run did not finish


def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit inside the largest tensor record of the zip (its data, not its header)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    # the local header: 30 bytes + name + extra (read from the header itself)
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def trained(bin_dataset, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("trained")
    run_training(tiny_config(bin_dataset, ckpt, max_steps=6, save_every=3, log_every=1))
    return ckpt


def test_bit_flip_in_a_tensor_is_found_on_load(trained, tmp_path):
    src = next(p for p in list_checkpoints(trained) if "step" in p.name)
    bad = tmp_path / src.name
    bad.write_bytes(src.read_bytes())
    load_checkpoint(bad)  # intact copy: loads
    _flip_tensor_byte(bad)
    torch.load(bad, weights_only=True)  # torch alone does not notice
    with pytest.raises(HydraCheckpointError, match="checksum mismatch"):
        load_checkpoint(bad)


def test_old_checkpoint_without_checksum_loads_with_a_note(trained, tmp_path):
    src = next(p for p in list_checkpoints(trained) if "step" in p.name)
    ck = torch.load(src, weights_only=True)
    ck.pop("checksum")
    old = tmp_path / src.name
    torch.save(ck, old)
    notes: list[str] = []
    assert load_checkpoint(old, log=notes.append)["step"] == ck["step"]
    assert any("no checksum" in n for n in notes)


def test_resume_with_only_unreadable_checkpoints_refuses_and_changes_nothing(bin_dataset, trained, tmp_path):
    for p in list_checkpoints(trained):
        (tmp_path / p.name).write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # truncated
    before = _folder_bytes(tmp_path)
    with pytest.raises(HydraCheckpointError, match="none of the 2 checkpoint"):
        run_training(tiny_config(bin_dataset, tmp_path, resume=True))
    assert _folder_bytes(tmp_path) == before


def test_refused_resume_leaves_tokenizer_json_untouched(bin_dataset, trained, tmp_path, monkeypatch):
    import hydra_train.run as run_mod

    for p in list_checkpoints(trained):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / "tokenizer.json").write_text('{"old": true}')
    new_tok = tmp_path.parent / "new_tokenizer.json"
    new_tok.write_text('{"new": true}')
    real = run_mod.load_run_data

    def with_tokenizer(cfg, log):
        data = real(cfg, log)
        data.tokenizer_path = new_tok
        return data

    monkeypatch.setattr(run_mod, "load_run_data", with_tokenizer)
    before = _folder_bytes(tmp_path)
    other = dict(tiny_config(bin_dataset, tmp_path).model_overrides, dim=128)  # another model config
    with pytest.raises(HydraCheckpointError, match="different model config"):
        run_training(tiny_config(bin_dataset, tmp_path, resume=True, model_overrides=other))
    assert _folder_bytes(tmp_path) == before


def test_a_live_lock_holder_is_named_and_a_dead_one_taken_over(bin_dataset, tmp_path):
    import socket

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(f"{holder.pid} {socket.gethostname()}\n")
        with pytest.raises(HydraTrainError, match=rf"another run \(PID {holder.pid} on "):
            run_training(tiny_config(bin_dataset, tmp_path, max_steps=1))
        assert not (tmp_path / "training.db").exists()
    finally:
        holder.kill()
        holder.wait()
    logs: list[str] = []

    from rich.console import Console

    console = Console(file=open(tmp_path.parent / "log.txt", "w"), width=300)  # noqa: SIM115
    run_training(tiny_config(bin_dataset, tmp_path, max_steps=1), console=console)
    console.file.close()
    logs = (tmp_path.parent / "log.txt").read_text()
    assert f"stale lock {tmp_path / LOCK_NAME} of run PID {holder.pid}" in logs.replace("\n", "")
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end
    assert _statuses(tmp_path) == ["finished"]


def test_resume_after_a_dead_run_marks_it_killed_and_logs_each_step_once(bin_dataset, tmp_path):
    cfg = tiny_config(bin_dataset, tmp_path, max_steps=6, save_every=3, log_every=1)
    run_training(cfg)
    # make it look like the run died after logging step 6 but before its final status and checkpoint
    for p in list_checkpoints(tmp_path):
        if p.name.endswith("_final.pt"):
            p.unlink()
    with sqlite3.connect(tmp_path / "training.db") as c:
        c.execute("UPDATE runs SET status='running'")
    (tmp_path / ".hydra_tiny_step6.pt.abc123.tmp").write_bytes(b"partial")
    run_training(cfg.replace(resume=True))
    assert _statuses(tmp_path) == ["killed", "finished"]
    assert not list(tmp_path.glob("*.tmp"))
    with sqlite3.connect(tmp_path / "training.db") as c:
        dup = c.execute("SELECT step, count(*) FROM steps GROUP BY step HAVING count(*) > 1").fetchall()
        steps = [r[0] for r in c.execute("SELECT step FROM steps ORDER BY step")]
    assert dup == []
    assert steps == [1, 2, 3, 4, 5, 6]


def test_markup_and_emoji_codes_in_the_checkpoint_path_are_printed_literally(bin_dataset, tmp_path):
    import io

    from rich.console import Console

    ckpt = tmp_path / "x[" / "c]:train:"  # ".../x[/c]:train:/...": a closing tag to rich markup
    out = io.StringIO()
    run_training(tiny_config(bin_dataset, ckpt, max_steps=3), console=Console(file=out, width=400))
    text = out.getvalue()
    assert f"saved {ckpt}/hydra_tiny_final.pt" in text, text
