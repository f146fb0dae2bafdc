"""Per-run artifacts in ``<checkpoint_dir>/runs/<run_id>/`` (the NSA diagnostics report's set).

=========================  =================================================================
``env.json``               when (UTC with the offset), versions (python, torch, triton, CUDA,
                           hydra packages), device, argv, HYDRA_*/PYTORCH_*/CUDA_*/TORCH_*
                           environment, world size, the kernel status and the attention backend
``dtypes_report.txt``      parameter and buffer counts per dtype, then every parameter
``opt_state_mb.txt``       optimizer state size in MiB after the first step (8-bit Adam shows here)
``heartbeat_rank{r}.jsonl`` one JSON line per log interval from every rank: step, time, loss, lr,
                           tokens/s, memory (a hung rank is the one whose heartbeat stopped)
``fallback_counters.csv``  at each log interval, rows ``step,time,source,name,count``: every op of
                           hydra_kernels.fallback_counts() (source ``kernel``), each reason of
                           hydra_model.attention_fallback_counts() (``attention``), each routing
                           function whose compile failed (``routing``, count 1: it runs op by op
                           from then on), and the total
``mem_boot.{txt,json}``    CUDA only: torch.cuda.memory_summary() / memory_stats() after the model
``mem_step{N}.{txt,json}`` is built, after the first logged step, and every
                           ``HYDRA_MEM_DUMP_EVERY=N`` steps
=========================  =================================================================
"""

from __future__ import annotations

import csv
import json
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hydra_train.callbacks import StepMetrics, TrainerCallback
from hydra_train.metrics_schema import utc_now
from hydra_train.options import recorded_environment, train_options


def fallback_counters() -> list[tuple[str, str, int]]:
    """``(source, name, count)``: every hydra-kernels op, then each attention fallback reason seen,
    then each routing function whose compile failed."""
    import hydra_kernels
    from hydra_model import attention_fallback_counts, compiled_routing_counts

    rows = [("kernel", op, int(n)) for op, n in hydra_kernels.fallback_counts().items()]
    rows += [("attention", reason, int(n)) for reason, n in sorted(attention_fallback_counts().items())]
    failed = {k.rsplit(":", 1)[0]: n for k, n in compiled_routing_counts().items() if k.endswith(":failed")}
    return rows + [("routing", name, int(n)) for name, n in sorted(failed.items())]


def optimizer_state_mb(opt: torch.optim.Optimizer) -> float:
    total = 0
    for st in opt.state.values():
        if isinstance(st, dict):
            for t in st.values():
                if torch.is_tensor(t):
                    total += t.numel() * t.element_size()
    return total / 2**20


def dtypes_report(model: torch.nn.Module) -> str:
    counts: dict[str, int] = {}
    bcounts: dict[str, int] = {}
    lines = []
    for name, p in model.named_parameters():
        counts[str(p.dtype)] = counts.get(str(p.dtype), 0) + p.numel()
        lines.append(f"  {name:<60} {p.dtype!s:<16} {tuple(p.shape)}")
    for _, b in model.named_buffers():
        bcounts[str(b.dtype)] = bcounts.get(str(b.dtype), 0) + b.numel()
    total = sum(counts.values()) or 1
    head = ["parameters by dtype:"]
    head += [f"  {dt:<16} {n:>14,d}  {100 * n / total:6.2f}%" for dt, n in sorted(counts.items())]
    head += ["buffers by dtype:"] + [f"  {dt:<16} {n:>14,d}" for dt, n in sorted(bcounts.items())]
    return "\n".join([*head, "parameters:", *lines]) + "\n"


def environment(device: torch.device, world_size: int) -> dict[str, Any]:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    env = {
        # UTC with the offset, as training.db's runs.started_at, which a reader holds it against
        # (the run folder's name, the run id, stays local time: run.py)
        "time": utc_now("seconds"),
        "host": socket.gethostname(),
        "python": sys.version,
        "platform": platform.platform(),
        "argv": sys.argv,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "world_size": world_size,
        "packages": {
            d: version(d)
            for d in (
                "hydra-kernels",
                "hydra-model",
                "hydra-train",
                "triton",
                "tokenizers",
                "bitsandbytes",
                "liger-kernel",
                "numpy",
            )
        },
        "environment": recorded_environment(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    try:
        import hydra_kernels

        env["kernel_status"] = hydra_kernels.get_kernel_status()
    except Exception as exc:  # status is informational; record why it is missing
        env["kernel_status"] = f"unavailable: {exc}"
    try:
        from hydra_model import get_attention_backend

        env["attention_backend"] = str(get_attention_backend())
    except Exception as exc:
        env["attention_backend"] = f"unavailable: {exc}"
    return env


class RunArtifacts:
    def __init__(self, folder: str | Path, rank: int = 0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def write_text(self, name: str, text: str) -> Path:
        p = self.folder / name
        p.write_text(text)
        return p

    def write_json(self, name: str, obj: Any) -> Path:
        return self.write_text(name, json.dumps(obj, indent=2, default=str) + "\n")

    def heartbeat(self, row: dict[str, Any]) -> None:
        with open(self.folder / f"heartbeat_rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": self.rank, **row}, default=str) + "\n")

    def fallback_row(self, step: int) -> None:
        """Append this interval's counters (long format: the attention reasons are open-ended)."""
        rows = fallback_counters()
        path = self.folder / "fallback_counters.csv"
        new = not path.exists()
        now = f"{time.time():.3f}"
        with open(path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "time", "source", "name", "count"])
            for source, name, n in rows:
                w.writerow([step, now, source, name, n])
            w.writerow([step, now, "all", "total_fallbacks", sum(n for _, _, n in rows)])

    def mem_dump(self, tag: str, device: torch.device) -> None:
        if device.type != "cuda":
            return
        torch.cuda.synchronize(device)
        self.write_text(f"mem_{tag}.txt", torch.cuda.memory_summary(device))
        stats = {
            k: int(v) if isinstance(v, (int, float)) else v
            for k, v in torch.cuda.memory_stats(device).items()
        }
        self.write_json(f"mem_{tag}.json", stats)


class ArtifactsCallback(TrainerCallback):
    """Writes the run artifacts at the right moments (rank 0, except the per-rank heartbeat)."""

    name = "artifacts"

    def __init__(self, artifacts: RunArtifacts):
        self.a = artifacts
        self.mem_every = train_options().mem_dump_every
        self._first_log_dumped = False

    def on_train_start(self, trainer) -> None:
        self.trainer = trainer
        if self.a.is_main:
            self.a.write_json("env.json", environment(trainer.device, trainer.dist.world_size))
            self.a.write_text("dtypes_report.txt", dtypes_report(trainer.model))
            self.a.mem_dump("boot", trainer.device)

    def on_step_end(self, step: int, metrics: StepMetrics) -> None:
        if not self.a.is_main:
            return
        if step == self.trainer._session_start_step + 1:
            mb = optimizer_state_mb(self.trainer.optimizer)
            self.a.write_text("opt_state_mb.txt", f"{mb:.2f}\n")
        if self.mem_every and step % self.mem_every == 0:
            self.a.mem_dump(f"step{step}", self.trainer.device)

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.a.heartbeat(
            {
                k: row.get(k)
                for k in (
                    "step",
                    "time",
                    "loss",
                    "lr",
                    "grad_norm",
                    "tokens_per_s",
                    "memory_mb",
                    "skipped_steps",
                    "ema_short",
                )
            }
        )
        if not self.a.is_main:
            return
        self.a.fallback_row(step)
        if not self._first_log_dumped:
            self._first_log_dumped = True
            if not (self.mem_every and step % self.mem_every == 0):
                self.a.mem_dump(f"step{step}", self.trainer.device)
