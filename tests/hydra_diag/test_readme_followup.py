"""The README's follow-up commands check the model the main command just trained."""

from __future__ import annotations

import re
from pathlib import Path

from hydra_train.checkpoint import final_name
from hydra_train.config import DeviceInfo, TrainConfig, model_id_for, resolve_config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_health_model_follow_up_uses_the_trained_checkpoint():
    text = README.read_text()
    cpu = resolve_config(TrainConfig(), DeviceInfo("cpu"))
    trained = f"{cpu.checkpoint_dir}/{final_name(model_id_for(cpu.model_size, cpu.arch))}"
    health = re.findall(r"^hatch run hydra-diag health model(.*)$", text, flags=re.M)
    assert health, "the README has no health model follow-up"
    assert all(f"--checkpoint {trained}" in line for line in health), health
    generate = re.findall(r"^hatch run hydra-model generate(.*)$", text, flags=re.M)
    assert generate and all(f"--checkpoint {trained}" in line for line in generate)
