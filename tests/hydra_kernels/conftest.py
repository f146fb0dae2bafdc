"""Shared fixtures of the hydra-kernels tests: every test starts and ends with the default
switches, no fallbacks counted and no launch overrides; ``seed`` draws a fresh seed per test."""

import os

import pytest
import torch

from hydra_kernels import controls
from hydra_kernels.launch_config import clear_launch_overrides


def _reset() -> None:
    controls.set_use_triton_kernels(True)
    controls.reload_env()
    controls.reset_fallback_counts()
    clear_launch_overrides()


@pytest.fixture(autouse=True)
def _default_kernel_controls():
    _reset()
    yield
    _reset()


@pytest.fixture
def seed() -> int:
    """A fresh random seed (not a fixed one that could hide a bug); tests print it on failure."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value
