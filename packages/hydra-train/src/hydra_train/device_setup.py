"""The process a run trains in: its device, the facts about it that resolve "auto" settings, CPU
threads, and the seeds."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from hydra_train.config import DeviceInfo
from hydra_train.errors import HydraTrainError


def pick_device(pref: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device ``--device pref`` names; under torchrun (``world_size`` > 1) ``cuda`` is each
    rank's LOCAL_RANK GPU, and ``cuda:N`` is refused: every rank would take the same GPU."""
    if pref.startswith("cuda:") and world_size > 1:
        raise HydraTrainError(
            f"--device {pref} names one GPU, but torchrun started {world_size} processes, which would "
            "all use it: pass --device cuda (each process takes its LOCAL_RANK's GPU) and choose the "
            "GPUs with CUDA_VISIBLE_DEVICES"
        )
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HydraTrainError("--device cuda was asked for but no CUDA GPU is visible here")
        return torch.device("cuda", local_rank) if pref == "cuda" else torch.device(pref)
    if pref != "cpu":
        raise HydraTrainError(f"--device {pref!r}: use auto, cpu, cuda or cuda:N")
    return torch.device("cpu")


def device_info(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo("cpu")
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo("cuda", props.total_memory / 2**30, torch.cuda.is_bf16_supported())


def choose_cpu_threads(requested: int | None) -> tuple[int, str]:
    """Intra-op threads for CPU training: ``requested``, or the cores nobody else is using.

    On a shared machine two OpenMP threads that keep getting descheduled wait on each other at every
    op; one thread is then several times faster than two, so "auto" counts busy cores by the load
    average."""
    if requested:
        return requested, "--cpu_threads"
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = max(1, min(cores, cores - round(load)))
    return n, f"auto: load average {load:.1f} on {cores} cores"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
