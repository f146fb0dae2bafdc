"""linear_cross_entropy's options in force: the defaults, then the ``HYDRA_LINEAR_CE_*``
environment, then :func:`set_linear_ce_options` (kept in ``hydra_kernels.options.OPTIONS``).

Separate from ``ops/linear_cross_entropy.py`` (which re-exports these functions, as do
``hydra_kernels`` and the registry's exports) so that the op's module holds its autograd, custom
ops and public function; what each option does is in that module's docstring and in
:class:`~hydra_kernels.ops._linear_ce_chunks.LinearCEOptions`.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace

from hydra_kernels.ops._linear_ce_chunks import LinearCEOptions
from hydra_kernels.options import OPTIONS

_ENV_OPTIONS = {
    "chunk_rows": "HYDRA_LINEAR_CE_CHUNK_ROWS",
    "dw_accum": "HYDRA_LINEAR_CE_DW_ACCUM",
    "dw_backend": "HYDRA_LINEAR_CE_DW_BACKEND",
}


def set_linear_ce_options(**values: object) -> None:
    """Override options for this process (``chunk_rows``, ``dw_accum``, ``dw_backend``); they win
    over the environment. :func:`reset_linear_ce_options` drops them."""
    known = {f.name for f in fields(LinearCEOptions)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(
            f"unknown linear_cross_entropy option(s) {sorted(unknown)}; expected {sorted(known)}"
        )
    replace(linear_ce_options(), **values).validated()  # reject bad values now, not at the next call
    OPTIONS.linear_ce.update(values)


def reset_linear_ce_options() -> None:
    OPTIONS.linear_ce.clear()


def linear_ce_options() -> LinearCEOptions:
    """The options in force: defaults, then the environment, then :func:`set_linear_ce_options`."""
    values: dict[str, object] = {}
    for name, var in _ENV_OPTIONS.items():
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        if name == "chunk_rows":
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} must be a whole number of tokens (0 = automatic)") from None
        else:
            values[name] = raw
    values.update(OPTIONS.linear_ce)
    return LinearCEOptions(**values).validated()  # type: ignore[arg-type]
