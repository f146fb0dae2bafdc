"""hydra_model's process-wide options, in one explicit object (:data:`OPTIONS`).

Which attention backend runs (attention_backend.py, attention_impls.py), whether the routing glue
runs compiled (fused_routing.py) and how a decode step runs CCGQA's convolutions (ccgqa.py) are
fields of a :class:`ModelOptions`; those modules read them there and nowhere else. Two kinds of thin entry
point fill it: environment variables, read when hydra_model is imported and again by
:func:`reload_env` (``HYDRA_ATTENTION_BACKEND``, ``HYDRA_SDPA_FLASH_ONLY``, ``HYDRA_SDPA_NO_FLASH``,
``HYDRA_COMPILED_ROUTING``, ``HYDRA_DECODE_CONV``), and the ``set_*`` functions (``set_attention_backend``,
``set_compiled_routing``), each of which sets one field. hydra_kernels' switches are
``hydra_kernels.kernel_options``, built the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: attention backends (attention_backend.py): ``auto`` measures and picks per shape
BACKENDS = ("auto", "flash", "xformers", "sdpa")
#: how a decode step runs CCGQA's convs and q-k mean (ccgqa.py): the head-wise batched GEMM plus
#: elementwise q-k mean of training, one GEMM over the token's window with everything inside, or
#: that GEMM reading only its weight's non-zero tiles (hydra_kernels.ops.tile_linear)
DECODE_CONVS = ("headwise", "window_gemm", "window_tiles")
_TRUE = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


@dataclass
class ModelOptions:
    """Every process-wide switch of hydra_model (see the module docstring)."""

    #: the requested attention backend, one of BACKENDS
    attention_backend: str = "auto"
    #: SDPA restricted to its flash kernel / kept off it
    sdpa_flash_only: bool = False
    sdpa_no_flash: bool = False
    #: the routing glue through torch.compile on CUDA during training
    compiled_routing: bool = True
    #: CCGQA's convolutions in a decode step, one of DECODE_CONVS: the window GEMM from its weight's
    #: non-zero tiles, timed fastest on an H100 (packages/hydra-model/BENCHMARKS.md, 2026-11-26)
    decode_conv: str = "window_tiles"


OPTIONS = ModelOptions()


def reload_env() -> None:
    """Re-read the environment variables into :data:`OPTIONS` (bad values raise ValueError)."""
    name = os.environ.get("HYDRA_ATTENTION_BACKEND", "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"HYDRA_ATTENTION_BACKEND={name!r}; expected one of {', '.join(BACKENDS)}")
    flash_only = os.environ.get("HYDRA_SDPA_FLASH_ONLY", "").strip().lower() in _TRUE
    no_flash = os.environ.get("HYDRA_SDPA_NO_FLASH", "").strip().lower() in _TRUE
    if flash_only and no_flash:
        raise ValueError("HYDRA_SDPA_FLASH_ONLY=1 and HYDRA_SDPA_NO_FLASH=1 contradict each other; set one")
    OPTIONS.attention_backend, OPTIONS.sdpa_flash_only, OPTIONS.sdpa_no_flash = name, flash_only, no_flash
    OPTIONS.compiled_routing = os.environ.get("HYDRA_COMPILED_ROUTING", "1").strip().lower() not in _OFF
    conv = os.environ.get("HYDRA_DECODE_CONV", "").strip().lower() or "window_tiles"
    if conv not in DECODE_CONVS:
        raise ValueError(f"HYDRA_DECODE_CONV={conv!r}; expected one of {', '.join(DECODE_CONVS)}")
    OPTIONS.decode_conv = conv


reload_env()
