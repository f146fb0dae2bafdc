"""Results as plain data: every diagnostic returns a JSON-able dict, and this turns what the
library functions produce (tensors, numpy scalars, paths, NaN) into that.

Non-finite floats become ``None`` so that ``--json`` output is strict JSON that any parser reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


class DiagError(RuntimeError):
    """A problem the user can fix (bad input, missing file, wrong device); the CLI prints it as one
    line on stderr and exits 1."""


class DiagUsageError(DiagError):
    """A value that is wrong by itself (an unknown preset or field, a number out of range), found
    before any work: the CLI prints it as one line and exits 2, as for a bad option."""


def jsonable(obj: Any) -> Any:
    """``obj`` with tensors, numpy values, paths and tuples turned into JSON types; NaN/inf → None."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return jsonable(obj.item())
        if isinstance(obj, np.ndarray):
            return jsonable(obj.tolist())
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu()
            return jsonable(t.item() if t.dim() == 0 else t.tolist())
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


Progress = Callable[[str], None]


def no_progress(_message: str) -> None:
    """The default progress callback of library functions: say nothing."""


def finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None
