"""How hydra-train's commands turn exceptions into one line and an exit status.

``hydra-train run`` maps: a flag out of range (:class:`HydraUsageError`) -> exit 2; any other
:class:`HydraTrainError` or an ``OSError`` (disk full, read-only folder, ...) -> one line naming the
cause, the file and what to do, exit 1; an SQLite error (the metrics database: a disk that filled
during a write reaches Python as ``sqlite3.OperationalError``, not an OSError) -> one line with
how to continue, exit 1; Ctrl-C -> 130, SIGTERM -> 143 (the run's status is written first, and
the step it stopped at saved when it was training: run_guard.RunSignals). ``--debug`` re-raises
instead, for the full traceback. The line itself is printed by
:func:`hydra_kernels.cli_support.fail`, which prints the text literally (no rich markup, no emoji).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_kernels.cli_support import EXIT_USAGE, fail

if TYPE_CHECKING:
    from hydra_train.config import TrainConfig

EXIT_SIGTERM = 143  # 128 + SIGTERM, what a shell reports for a process ended by kill
EXIT_SIGINT = 130


def run_arguments(cfg: TrainConfig) -> list[str]:
    """The ``hydra-train run`` options that give ``cfg`` (those not at their default), ``--resume``
    left out: what an interrupted run is continued with. A resume refuses another --seq_len or
    --seed and looks for the checkpoints of its own model, so the hint must repeat them.
    ``--allow_data_change`` is left out too: it consents to one change of data, and the
    checkpoints written after it record the new data (a later change must be refused again)."""
    from hydra_train.config_options import RUN, SECTIONS

    args: list[str] = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("cli")
            value = getattr(getattr(cfg, section), f.name)
            if spec is None or RUN not in spec.commands or f.name in ("resume", "allow_data_change"):
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if value == default:
                continue
            flag = spec.flags[0]
            if isinstance(value, dict):  # --model_override FIELD=VALUE, as parse_assignments reads it
                for k, v in value.items():
                    args += [flag, f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
            elif isinstance(value, bool):
                args.append(flag if value else "--no-" + flag.removeprefix("--"))
            else:
                args += [flag, str(value)]
    return args


def run_model_id(cfg: TrainConfig) -> str | None:
    """The model id this run's checkpoints are named by, as the run computes it (run.py:
    ``model_id_for`` of the size resolved for its device, ``--model_size auto`` included); None
    when that cannot be worked out (a configuration the run itself refused)."""
    from hydra_train.config import model_id_for, resolve_config
    from hydra_train.device_setup import device_info, pick_device
    from hydra_train.options import torchrun_launch

    try:
        size = cfg.model.model_size
        if size == "auto":  # the preset follows the device, as the run resolved it
            launch = torchrun_launch()
            device = pick_device(cfg.runtime.device, launch.local_rank, launch.world_size)
            size = resolve_config(cfg, device_info(device)).model.model_size
        return model_id_for(size, cfg.model.arch)
    except Exception:
        return None


def resume_hint(cfg: TrainConfig) -> str:
    """What continues an interrupted ``hydra-train run ...``: its own options and ``--resume``, or,
    before its first checkpoint, the same command again (``--resume`` would find nothing). Only
    this run's model's checkpoints count, as for ``--resume`` (checkpoint.check_resume_dir):
    another model's in the same folder made it suggest a ``--resume`` that was then refused."""
    from hydra_train.checkpoint import list_checkpoints

    again = shlex.join(["hydra-train", "run", *run_arguments(cfg)])
    # an id that cannot be worked out (None): any model's checkpoint counts, as it always did
    if not list_checkpoints(Path(cfg.runtime.checkpoint_dir), run_model_id(cfg)):
        return f"{again} (no checkpoint was saved yet, so it starts over)"
    return f"{again} --resume"


def run_guarded(fn: Callable[[], Any], *, debug: bool, resume_hint: str | Callable[[], str]) -> Any:
    """Call ``fn``; user-facing failures become one line (see the module docstring).
    ``resume_hint`` (or a function that makes it, when the run stops) says how to continue."""
    from hydra_train.errors import HydraTrainError, HydraUsageError
    from hydra_train.run_guard import Terminated, os_error_line

    try:
        return fn()
    except HydraUsageError as exc:
        if debug:
            raise
        fail(str(exc), code=EXIT_USAGE)
    except HydraTrainError as exc:
        if debug:
            raise
        fail(str(exc))
    except OSError as exc:
        if debug:
            raise
        fail(os_error_line(exc, "I/O error"))
    except sqlite3.Error as exc:
        if debug:
            raise
        fail(
            _stopped(
                f"metrics database error: {exc} (training.db in --checkpoint_dir); {_sqlite_hint(exc)}",
                resume_hint,
            )
        )
    except Terminated:
        fail(_stopped("terminated (SIGTERM)", resume_hint), code=EXIT_SIGTERM)
    except KeyboardInterrupt:
        fail(_stopped("interrupted", resume_hint), code=EXIT_SIGINT)


def _sqlite_hint(exc: sqlite3.Error) -> str:
    """What to do about an SQLite error, by its code (Python 3.11+ names it)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return "another process holds the database: end it (or wait), then continue"
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return "the file is damaged: hydra-train db rebuild remakes it from the run's exports"
    return "free disk space or check that the folder is writable"


def _stopped(what: str, hint: str | Callable[[], str]) -> str:
    hint = hint() if callable(hint) else hint
    return f"{what}; continue with: {hint}" if hint else what
