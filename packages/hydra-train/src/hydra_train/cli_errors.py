"""How hydra-train's commands turn exceptions into one line and an exit status.

``hydra-train run`` maps: a flag out of range (:class:`HydraUsageError`) -> exit 2; any other
:class:`HydraTrainError` or an ``OSError`` (disk full, read-only folder, ...) -> one line naming the
cause, the file and what to do, exit 1; Ctrl-C -> 130, SIGTERM -> 143 (the run's status is written
first). ``--debug`` re-raises instead, for the full traceback. The line itself is printed by
:func:`hydra_kernels.cli_support.fail`, which prints the text literally (no rich markup, no emoji).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hydra_kernels.cli_support import EXIT_USAGE, fail

EXIT_SIGTERM = 143  # 128 + SIGTERM, what a shell reports for a process ended by kill
EXIT_SIGINT = 130


def run_guarded(fn: Callable[[], Any], *, debug: bool, resume_hint: str) -> Any:
    """Call ``fn``; user-facing failures become one line (see the module docstring)."""
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
    except Terminated:
        fail(f"terminated (SIGTERM); continue with: {resume_hint}", code=EXIT_SIGTERM)
    except KeyboardInterrupt:
        fail(f"interrupted; continue with: {resume_hint}", code=EXIT_SIGINT)
