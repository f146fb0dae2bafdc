"""Atomic saves (a crash mid-write leaves the previous checkpoint valid), finding the newest valid
checkpoint, pruning, RNG capture, and refusing a checkpoint of another model config."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hydra_model import preset_config
from hydra_train.checkpoint import (
    FORMAT,
    capture_rng,
    check_model_config,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    restore_rng,
    save_checkpoint,
    step_name,
)
from hydra_train.errors import HydraCheckpointError


def _payload(step: int, **extra):
    return {
        "format": FORMAT,
        "version": 1,
        "step": step,
        "time": float(step),
        "model": {"w": torch.randn(64, 64)},
        "config": {"model": preset_config("tiny").to_dict(), "train": {}},
        **extra,
    }


def test_roundtrip_and_no_temp_files(tmp_path):
    p = save_checkpoint(_payload(3), tmp_path / step_name("tiny", 3))
    ck = load_checkpoint(p)
    assert ck["step"] == 3 and ck["model"]["w"].shape == (64, 64)
    assert [x.name for x in tmp_path.iterdir()] == ["hydra_tiny_step3.pt"]


def test_crash_during_write_leaves_previous_checkpoint_valid(tmp_path):
    # A child process saves step 1, then dies (os._exit: no cleanup, like a kill) half way through
    # writing step 2. The parent then checks what a resume would see.
    child = textwrap.dedent(f"""
        import os, torch
        from hydra_model import preset_config
        from hydra_train.checkpoint import FORMAT, save_checkpoint
        def payload(step):
            return {{"format": FORMAT, "version": 1, "step": step, "time": float(step),
                    "model": {{"w": torch.full((256, 256), float(step))}},
                    "config": {{"model": preset_config("tiny").to_dict(), "train": {{}}}}}}
        save_checkpoint(payload(1), {str(tmp_path)!r} + "/hydra_tiny_step1.pt")
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            import io
            buf = io.BytesIO(); real_save(obj, buf, *a, **k)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2]); f.flush()
            os._exit(9)
        torch.save = dying_save
        save_checkpoint(payload(2), {str(tmp_path)!r} + "/hydra_tiny_step2.pt")
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "hydra_tiny_step2.pt" not in names
    assert any(n.startswith(".hydra_tiny_step2.pt.") and n.endswith(".tmp") for n in names)  # the torn write
    point = find_resume_checkpoint(tmp_path, log=lambda m: None)
    assert point.step == 1 and torch.equal(point.checkpoint["model"]["w"], torch.full((256, 256), 1.0))


def test_truncated_newest_checkpoint_is_skipped_with_a_message(tmp_path):
    save_checkpoint(_payload(1), tmp_path / step_name("tiny", 1))
    p2 = save_checkpoint(_payload(2), tmp_path / step_name("tiny", 2))
    p2.write_bytes(p2.read_bytes()[:-200])
    (tmp_path / step_name("tiny", 3)).write_bytes(b"")
    msgs: list[str] = []
    point = find_resume_checkpoint(tmp_path, log=msgs.append)
    assert point.step == 1
    assert any("hydra_tiny_step2.pt" in m and "unreadable" in m for m in msgs)
    assert any("hydra_tiny_step3.pt" in m for m in msgs)
    assert find_resume_checkpoint(tmp_path / "nothing-here", log=msgs.append) is None


def test_an_unreadable_checkpoints_reason_is_whole(tmp_path):
    """torch's reason for a truncated file is four sentences: the line keeps whole ones and closes
    its parenthesis (it was cut at 400 characters, mid-word)."""
    p = save_checkpoint(_payload(1), tmp_path / step_name("tiny", 1))
    p.write_bytes(p.read_bytes()[:100])  # no zip directory left: torch's long reason
    with pytest.raises(HydraCheckpointError) as err:
        load_checkpoint(p)
    line = str(err.value)
    assert "unreadable checkpoint (" in line and "central directory" in line, line
    assert line.endswith(".)") and "\n" not in line, line


def test_newest_is_by_save_time_not_name(tmp_path):
    save_checkpoint(_payload(900, time=1.0), tmp_path / step_name("tiny", 900))
    save_checkpoint(_payload(100, time=2.0), tmp_path / "hydra_tiny_final.pt")
    assert find_resume_checkpoint(tmp_path).path.name == "hydra_tiny_final.pt"


def test_prune_keeps_last_k_step_files(tmp_path):
    for s in (5, 10, 15, 20):
        save_checkpoint(_payload(s), tmp_path / step_name("tiny", s))
    save_checkpoint(_payload(20), tmp_path / "hydra_tiny_final.pt")
    save_checkpoint(_payload(1), tmp_path / step_name("debug", 1))
    removed = prune_checkpoints(tmp_path, "tiny", keep=2)
    assert sorted(p.name for p in removed) == ["hydra_tiny_step10.pt", "hydra_tiny_step5.pt"]
    assert [p.name for p in list_checkpoints(tmp_path, "tiny")] == [
        "hydra_tiny_final.pt",
        "hydra_tiny_step15.pt",
        "hydra_tiny_step20.pt",
    ]
    assert (tmp_path / "hydra_debug_step1.pt").exists()  # other models untouched
    assert prune_checkpoints(tmp_path, "tiny", keep=0) == []


def test_other_model_config_is_refused_listing_the_differences(tmp_path):
    ck = _payload(1)
    current = preset_config("tiny", dim=128, moe_enabled=True, use_chunked_ce=True)
    with pytest.raises(HydraCheckpointError) as ei:
        check_model_config(ck, current, tmp_path / "x.pt")
    msg = str(ei.value)
    assert "dim: 256 != 128" in msg and "moe_enabled: False != True" in msg
    assert "use_chunked_ce" not in msg  # a runtime switch, allowed to change on resume
    check_model_config(ck, preset_config("tiny", use_chunked_ce=True), tmp_path / "x.pt")  # no error


def test_rng_capture_restore_survives_a_weights_only_save(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_checkpoint({**_payload(1), "rng": capture_rng()}, tmp_path / "r.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(load_checkpoint(tmp_path / "r.pt")["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def test_not_a_checkpoint(tmp_path):
    torch.save({"hello": 1}, tmp_path / "hydra_tiny_step1.pt")
    with pytest.raises(HydraCheckpointError, match="not a hydra-train checkpoint"):
        load_checkpoint(tmp_path / "hydra_tiny_step1.pt")


@pytest.mark.parametrize("size", ["250M", "500M", "1B"])
def test_the_refusal_names_the_overrides_that_rebuild_a_changed_preset(size, tmp_path):
    """A checkpoint of a preset's seed layout (PRE_RACE_PRESETS), resumed with today's preset: the
    message's --model_override flags, applied to the preset, give back the saved config exactly."""
    from hydra_kernels.cli_support import parse_assignments
    from hydra_model import HydraConfig
    from hydra_model.config import PRE_RACE_PRESETS

    saved = HydraConfig(**PRE_RACE_PRESETS[size])
    ckpt = {"config": {"model": saved.to_dict()}}
    with pytest.raises(HydraCheckpointError, match="different model config") as info:
        check_model_config(ckpt, preset_config(size), tmp_path / "ck.pt")
    hint = str(info.value).split("(here: ", 1)[1].split(")", 1)[0]
    items = hint.replace("--model_override ", "").split()
    assert preset_config(size, **parse_assignments(items)) == saved
