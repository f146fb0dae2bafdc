"""PretestHook: when pretests rerun, where their results go, and what the logs say.

Logs (``<checkpoint_dir>/pretest_logs/``)::

    pretest_history.json          every pretest record, appended (a JSON list)
    pretest_<size>_<date>.json    that size's records of that day (a JSON list)
    safe_opts_events.jsonl        what the monitor did during training, one event per line

The files are standard JSON: a number that is not finite (a failed arm's loss or timing) is null,
as in the CLIs' ``--json`` (``finite_json``); files written before, holding NaN or Infinity, still
read. An event's and a record's ``time`` are UTC with the offset, to the second, as the runs
table's times in training.db are (hydra-diag's dashboard gives a run the events stamped between its
start and end), so that a record says the same moment on every machine; a day file is named by the
UTC date. Older versions wrote local time without an offset: such a stamp is read as this machine's
local time (``metrics_schema.utc_time``, as the database reads its older rows), and report.py
orders records by that time, not by their text.

A record is a dict: ``time``, ``model_size``, ``fingerprint``, ``trigger``, ``checkpoint``,
``env`` (device, compute capability, torch/triton versions), ``config`` (batch, sequence length,
precision, model widths), ``requested``, ``settings``, ``bounds``, ``default`` (the safe default's
numbers) and ``results`` (per optimization: ``status`` PASS / FAIL / N/A, ``reason``, the numerics
and timing behind the verdict).

Rerun rule: a fingerprint hashes the model config, the training settings that change what a step
computes or costs (batch, length, precision, the optimization flags), the checkpoint the run
resumed from, the device and versions, and the source of hydra-kernels, hydra-model and hydra-train
(any edit to the code a pretest runs makes a new fingerprint). A fingerprint seen before reuses
that record (no rerun). Otherwise the pretests run, and the trigger says why: ``first run``,
``model size changed``, ``new checkpoint loaded`` or ``config changed``.

The machine's shared records (``shared_dir``, ``$HYDRA_CACHE_DIR/pretests`` for ``hydra-train run``;
:func:`shared_pretest_dir`): one ``<fingerprint>.json`` per record, written by every run that
pretested, so that a new run of the same configuration in another checkpoint folder reuses the
verdicts instead of spending its setup on them (``--no-reuse_pretests`` reruns them). A reused
record is copied into the run's own history with ``reused_from`` naming the file. A machine
record with a FAIL for speed is not reused (such verdicts move between runs): the run pretests.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import platform
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hydra_kernels.cli_support import finite_json
from hydra_train.atomic_files import atomic_write_bytes
from hydra_train.config import TrainConfig
from hydra_train.metrics_schema import utc_now, utc_time
from hydra_train.safe_opts.tolerances import failed_on_speed

HISTORY = "pretest_history.json"
EVENTS = "safe_opts_events.jsonl"

#: TrainConfig fields that change what a pretest measures.
FINGERPRINT_FIELDS = (
    "model_size",
    "batch_size",
    "seq_len",
    "grad_accum",
    "precision",
    "moe",
    "moe_num_experts",
    "static_routing_mode",
    "chunked_ce",
    "checkpoint_every",
    "triton_kernels",
    "compile",
    "compile_scope",
    "eight_bit_adam",
    "experimental_fa3",
    "experimental_cuda_graphs",
    "experimental_blackwell_tuning",
    "triton_block_q",
    "triton_block_kv",
    "triton_num_warps",
    "experimental_fp8",
    "fp8_format",
    "fp8_scaling",
    "experimental_prefetch_threads",
    "prefetch_buffer_size",
    "pretest_warmup_steps",
    "pretest_steps",
    "grad_clip",
)


#: The packages whose code a pretest runs (their source is part of the fingerprint).
SOURCE_PACKAGES = ("hydra_kernels", "hydra_model", "hydra_train")


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of every ``.py`` file of :data:`SOURCE_PACKAGES` (names and bytes; read once a process)."""
    h = hashlib.sha1()
    for name in SOURCE_PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for p in sorted(root.rglob("*.py")):
            h.update(f"{name}/{p.relative_to(root).as_posix()}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


#: Distributions whose version changes what a pretest measures (absent ones are recorded as None).
OPTIONAL_PACKAGES = ("bitsandbytes", "flash-attn", "flash_attn_3", "xformers")


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def event_time(stamp: str | None = None) -> str:
    """An event's ``time`` in the log: ``stamp`` (now when None) in UTC with its offset, to the
    second. A stamp without an offset is local time (an older version's events; SafeOptimizations
    now stamps its events with this function)."""
    return utc_time(stamp, "seconds") if stamp else utc_now("seconds")


def timestamp(stamp: str | None = None) -> str:
    """A record's ``time``: as an event's (:func:`event_time`), UTC with its offset, to the second."""
    return event_time(stamp)


def shared_pretest_dir() -> Path:
    """This machine's pretest records shared by runs: ``$HYDRA_CACHE_DIR/pretests``."""
    from hydra_train.options import train_options

    return train_options().cache_dir / "pretests"


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hydra_source": source_hash(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    # the optional packages a pretested path runs (8-bit Adam, attention kernels): their versions
    env["optional"] = {name: _installed_version(name) for name in OPTIONAL_PACKAGES}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = platform.processor() or platform.machine() or "cpu"
        env["capability"] = None
    return env


def fingerprint(
    model_config: dict[str, Any], cfg: TrainConfig, env: dict[str, Any], checkpoint: str | None
) -> str:
    payload = {
        "model": model_config,
        "train": {k: getattr(cfg, k) for k in FINGERPRINT_FIELDS},
        "env": env,
        "checkpoint": checkpoint,
    }
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_json_atomic(path: Path, data: Any) -> None:
    atomic_write_bytes(path, json.dumps(finite_json(data), indent=1, default=str).encode("utf-8"))


def _read_list(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path} is not a JSON list of pretest records")
    return data


def _missing(rec: dict[str, Any], needed: list[str]) -> list[str]:
    """The names of ``needed`` that ``rec`` has no result for."""
    results = rec.get("results")
    results = results if isinstance(results, dict) else {}
    return [n for n in needed if n not in results]


class PretestHook:
    """Decides whether pretests must run, stores their records, answers questions about them."""

    def __init__(self, log_dir: str | Path, shared_dir: str | Path | None = None):
        self.log_dir = Path(log_dir)
        #: the machine's records (None: this folder's history only)
        self.shared_dir = None if shared_dir is None else Path(shared_dir)

    @property
    def history_path(self) -> Path:
        return self.log_dir / HISTORY

    def _history(self) -> list[dict[str, Any]]:
        return _read_list(self.history_path)

    def decide(
        self,
        fp: str,
        model_size: str,
        checkpoint: str | None,
        *,
        reuse_shared: bool = True,
        needed: Iterable[str] = (),
    ) -> tuple[str | None, dict | None]:
        """(trigger, None) when the pretests must run; (None, record) to reuse ``record``: this
        folder's, else (``reuse_shared``) the machine's, marked ``machine_record`` (the caller
        copies it into this folder's history). Without ``reuse_shared`` this folder's copies of
        machine records do not count either. A record is reused only when it holds a result for
        each of ``needed`` (the names the run pretests): ``hydra-train pretest --only`` writes
        records of the same fingerprint with fewer results, which must not stand for the rest."""
        need = list(needed)
        hist = self._history()
        same = [r for r in hist if r.get("fingerprint") == fp and (reuse_shared or "reused_from" not in r)]
        whole = [r for r in same if not _missing(r, need)]
        if whole:
            return None, whole[-1]
        shared, why = self._shared(fp) if reuse_shared else (None, None)
        lacking = _missing(shared, need) if shared is not None else []
        if lacking:
            shared, why = None, f"the machine's record lacks {', '.join(lacking)}; pretesting again"
        if shared is not None:
            return None, shared
        if why:
            return why, None
        if same:
            return f"the last record of this fingerprint lacks {', '.join(_missing(same[-1], need))}", None
        if not hist:
            return "first run", None
        last = hist[-1]
        if last.get("model_size") != model_size:
            return f"model size changed ({last.get('model_size')} -> {model_size})", None
        if checkpoint and checkpoint != last.get("checkpoint"):
            return f"new checkpoint loaded ({checkpoint})", None
        return "config changed", None

    def _shared(self, fp: str) -> tuple[dict[str, Any] | None, str | None]:
        """(the machine's record of ``fp`` with ``reused_from`` set, None), or (None, why a record
        there cannot be used), or (None, None) when there is none."""
        if self.shared_dir is None:
            return None, None
        path = self.shared_dir / f"{fp}.json"
        try:
            if not path.is_file():
                return None, None
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return None, f"the machine's record {path} is unreadable ({type(exc).__name__}); pretesting again"
        results = rec.get("results") if isinstance(rec, dict) else None
        if (
            not isinstance(rec, dict)
            or rec.get("fingerprint") != fp
            or not isinstance(results, dict)
            or not all(isinstance(r, dict) for r in results.values())
        ):
            return None, f"the machine's record {path} is not a pretest record of {fp}; pretesting again"
        # a speed verdict near its margin moves between runs (fa3 +7% in one run, 0.97x in the
        # next, BENCHMARKS.md): a FAIL for speed is measured again rather than kept for every run
        slow = sorted(n for n, r in results.items() if failed_on_speed(r))
        if slow:
            return None, f"the machine's record failed {', '.join(slow)} on speed; pretesting again"
        return {**rec, "reused_from": str(path), "machine_record": True}, None

    def share(self, rec: dict[str, Any]) -> Path | None:
        """Write ``rec`` as the machine's record of its fingerprint (None: no shared folder).
        Raises OSError when the folder cannot be written (the caller says so and goes on)."""
        if self.shared_dir is None:
            return None
        path = self.shared_dir / f"{rec['fingerprint']}.json"
        _write_json_atomic(path, rec)
        return path

    def adopt(self, machine_rec: dict[str, Any]) -> Path:
        """Copy a machine record :meth:`decide` returned into this folder's history: what the run
        trusted, from where (``reused_from``), first recorded when (``recorded``); stamped now."""
        copy = {k: v for k, v in machine_rec.items() if k != "machine_record"}
        copy.update(trigger="reused (machine)", recorded=machine_rec.get("time"), time=timestamp())
        return self.record(copy)

    def record(self, rec: dict[str, Any]) -> Path:
        """Append ``rec`` to the history and to that size's log of its UTC day; returns the latter.
        ``rec``'s ``time`` (now when it has none) is written in UTC (:func:`timestamp`)."""
        # a caller's stamp without an offset (an older version's) is local: stored, and filed by
        # day, as the UTC moment it names
        rec = {**rec, "time": timestamp(rec.get("time"))}
        hist = self._history()
        hist.append(rec)
        _write_json_atomic(self.history_path, hist)
        day = self.log_dir / f"pretest_{rec['model_size']}_{rec['time'][:10]}.json"
        runs = _read_list(day)
        runs.append(rec)
        _write_json_atomic(day, runs)
        return day

    def log_event(self, event: dict[str, Any]) -> None:
        """Append ``event`` to the event log, its ``time`` in UTC (:func:`event_time`)."""
        line = finite_json({**event, "time": event_time(event.get("time"))})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / EVENTS, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")

    def events(self) -> list[dict[str, Any]]:
        path = self.log_dir / EVENTS
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    # -- questions -------------------------------------------------------------------------------
    def get_history(self, model_size: str | None = None) -> list[dict[str, Any]]:
        hist = self._history()
        return hist if model_size is None else [r for r in hist if r.get("model_size") == model_size]

    def get_summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per model size, per optimization: the latest status and reason, and counts over all runs."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for rec in self._history():
            size = rec.get("model_size", "?")
            for name, r in (rec.get("results") or {}).items():
                entry = out.setdefault(size, {}).setdefault(name, {"counts": Counter()})
                entry["counts"][r.get("status")] += 1
                entry.update(
                    status=r.get("status"),
                    reason=r.get("reason"),
                    time=rec.get("time"),
                    device=(rec.get("env") or {}).get("device"),
                    speedup=(r.get("timing") or {}).get("speedup"),
                )
        for per in out.values():
            for entry in per.values():
                entry["counts"] = dict(entry["counts"])
        return out

    def print_summary(self, console=None) -> None:
        """The summary as a table, or at a narrow width (80 columns) one block per optimization:
        hydra_kernels' print_records, which never cuts a name or a date."""
        from rich.console import Console
        from rich.markup import escape

        from hydra_kernels.cli_format import print_records

        console = console or Console()
        summary = self.get_summary()
        if not summary:
            console.print(f"no pretest records in {self.history_path}", markup=False, highlight=False)
            return
        rows = []
        for size, per in summary.items():
            for name, e in per.items():
                c, sp = e["counts"], e.get("speedup")
                rows.append(
                    {
                        "model": size,
                        "optimization": name,
                        "latest": e["status"],
                        "reason": (e.get("reason") or "")[:70],
                        "speedup": "-" if sp is None else f"{sp:.2f}x",
                        "PASS/FAIL/N/A": f"{c.get('PASS', 0)}/{c.get('FAIL', 0)}/{c.get('N/A', 0)}",
                        "when": e.get("time"),
                        "device": e.get("device"),
                    }
                )
        # the cells are literal (a reason's "[...]" is not markup)
        print_records(
            console,
            f"pretest history ({self.history_path})",
            rows,
            list(rows[0]),
            fmt=lambda v: "-" if v is None else escape(str(v)),
        )
