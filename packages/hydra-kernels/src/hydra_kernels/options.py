"""hydra_kernels' process-wide options, in one explicit object.

Which implementation each op runs (Triton or the PyTorch reference, forward and backward), the
Liger-Kernel hand-off of ``linear_cross_entropy``, the Blackwell launch table, launch overrides and
``linear_cross_entropy``'s options are the fields of :data:`OPTIONS`, a :class:`KernelOptions`. The
rest of the package reads them there and nowhere else.

Two kinds of entry point fill it, both thin:

* the environment variables of the seed documents, read when hydra_kernels is imported and again
  by :func:`reload_env` (``HYDRA_DISABLE_TRITON``, ``HYDRA_ENABLE_FUSED_<OP>[_BWD]`` /
  ``HYDRA_DISABLE_FUSED_<OP>[_BWD]``, ``HYDRA_ENABLE_LIGER_CE``, ``HYDRA_TRITON_NUM_WARPS`` /
  ``_NUM_STAGES`` / ``_BLOCK_ROWS`` / ``_BLOCK_Q`` / ``_BLOCK_KV``; the table is in
  :mod:`hydra_kernels.controls` and :mod:`hydra_kernels.launch_config`);
* the ``set_*`` functions (``set_use_triton_kernels``, ``set_op_enabled``, ``set_use_liger_ce``,
  ``set_blackwell_tuning``, ``set_launch_overrides``, ``set_linear_ce_options``), each of which sets
  one field.

``HYDRA_LINEAR_CE_*`` are read when ``linear_cross_entropy`` runs (its options: the environment,
then ``OPTIONS.linear_ce`` on top), and ``HYDRA_FAST_LAUNCH`` once at import by
:mod:`hydra_kernels.ops._launch`, which turns it off for good if a launcher refuses a call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str) -> bool | None:
    """True/False for a set boolean variable, None when unset or empty. Unknown values raise."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r} is not a boolean; use 1 or 0")


def env_switch(stem: str) -> bool:
    """``HYDRA_DISABLE_<stem>=1`` wins, then ``HYDRA_ENABLE_<stem>``, default on."""
    if env_flag(f"HYDRA_DISABLE_{stem}"):
        return False
    enable = env_flag(f"HYDRA_ENABLE_{stem}")
    return True if enable is None else enable


@dataclass
class OpSwitch:
    """One op's Triton kernels: forward on, and its backward (only ever on with the forward)."""

    forward: bool = True
    backward: bool = True


@dataclass
class KernelOptions:
    """Every process-wide switch of hydra_kernels (see the module docstring)."""

    #: Triton kernels at all (``set_use_triton_kernels``; ``HYDRA_DISABLE_TRITON=1`` turns it off)
    triton: bool = True
    #: per op (the names of ``hydra_kernels.controls.OPS``)
    ops: dict[str, OpSwitch] = field(default_factory=dict)
    #: ``linear_cross_entropy`` hands off to Liger-Kernel when it is importable
    liger_ce: bool = False
    #: the op tables' ``"blackwell"`` entries on sm_100/sm_120 (off: their ``"default"`` entries)
    blackwell_tuning: bool = True
    #: launch fields from ``HYDRA_TRITON_*`` (every op)
    launch_env: dict[str, int] = field(default_factory=dict)
    #: a malformed ``HYDRA_TRITON_*`` variable: raised when a launch is resolved, not at import
    launch_env_error: ValueError | None = None
    #: ``set_launch_overrides``: op name (None: every op) -> launch fields, over ``launch_env``
    launch_overrides: dict[str | None, dict[str, int]] = field(default_factory=dict)
    #: ``set_linear_ce_options``: over the ``HYDRA_LINEAR_CE_*`` environment
    linear_ce: dict[str, object] = field(default_factory=dict)


#: The options in force in this process.
OPTIONS = KernelOptions()
