"""What bounds one pretest arm (:mod:`hydra_train.safe_opts.pretest`): its wall-clock limit, and
the one line its failure is reported as."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback


def error_text(exc: BaseException) -> str:
    """``Type: message``; where the message is empty (a bare ``assert``), the file and line that
    raised it instead, so that the pretest log says where to look."""
    text = str(exc).strip()[:300]
    if not text and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"raised at {os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return f"{type(exc).__name__}: {text}"


class ArmTimeout(BaseException):
    """An arm over its time limit. Not an Exception: code the arm runs that catches its own
    failures (auto's attention measurement, say) must not swallow it and leave the arm unlimited."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`ArmTimeout` in this (main) thread after ``seconds`` (SIGALRM; a no-op where
    that is unavailable, e.g. off the main thread or on Windows)."""
    usable = (
        seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise ArmTimeout(f"did not finish within {seconds:g} s (warmup and compilation included)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
