"""When a run compiles by default, and which scope ``--compile_scope auto`` takes: the rules
:func:`hydra_train.config.resolve_config` applies and the reason ``--dry_run`` and the run's log
print. They go by the tokens a process plans to read (thresholds in
:mod:`hydra_train.config_options`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hydra_train.config_options import (
    COMPILE_TOKENS,
    COMPILE_TOKENS_DDP,
    WHOLE_MODEL_COMPILE_TOKENS,
    WHOLE_MODEL_COMPILE_TOKENS_DDP,
)

if TYPE_CHECKING:
    from hydra_train.config import TrainConfig


def planned_tokens(cfg: TrainConfig) -> int:
    """Training tokens one process plans to read: steps × batch × length × accumulation."""
    return cfg.max_steps * cfg.batch_size * cfg.seq_len * cfg.grad_accum


def _threshold(one_process: int, under_torchrun: int) -> tuple[int, str]:
    """(the planned-token threshold that applies to this process, how its reasons say per what):
    ``one_process`` alone, ``under_torchrun`` a process when launched by torchrun."""
    from hydra_train.options import torchrun_launch

    if torchrun_launch().world_size == 1:
        return one_process, ""
    return under_torchrun, " a process under torchrun"


def _compile_rule(cfg: TrainConfig, kind: str) -> tuple[bool, str]:
    """(whether a run that said neither ``--compile`` nor ``--no-compile`` compiles, why): on CUDA
    when it plans at least :data:`COMPILE_TOKENS` tokens (:data:`COMPILE_TOKENS_DDP` a process
    under torchrun, FSDP2 included: its compiled blocks were 1.16x its eager steps on two H200s,
    packages/hydra-train/BENCHMARKS.md); a shorter run spends more on the compile than it saves."""
    if kind != "cuda":
        return False, "off on the CPU"
    least, per = _threshold(COMPILE_TOKENS, COMPILE_TOKENS_DDP)
    tokens = planned_tokens(cfg)
    planned = f"{tokens / 1e6:,.1f}M planned tokens{per}"
    if tokens < least:
        short = "too short to repay the compile (--compile forces it)"
        return False, f"off: {planned} < {least / 1e6:.0f}M, {short}"
    return True, f"on: {planned} >= {least / 1e6:.0f}M"


def _scope_rule(cfg: TrainConfig) -> tuple[str, str]:
    """(``--compile_scope auto``'s scope, why): the whole forward for a run of at least
    :data:`WHOLE_MODEL_COMPILE_TOKENS` planned tokens (:data:`WHOLE_MODEL_COMPILE_TOKENS_DDP` a
    process under torchrun), else each block; always each block with FSDP2."""
    if cfg.fsdp:
        return "blocks", "the scope FSDP2 takes: its hooks gather each block's parameters"
    least, per = _threshold(WHOLE_MODEL_COMPILE_TOKENS, WHOLE_MODEL_COMPILE_TOKENS_DDP)
    whole = f"{least / 1e6:.0f}M{per}"
    if planned_tokens(cfg) >= least:
        return "model", f">= {whole}"
    return "blocks", f"< {whole} for the whole forward"


def compile_by_default(cfg: TrainConfig, kind: str) -> bool:
    """Whether a run that gave neither compile flag compiles (:func:`_compile_rule`)."""
    return _compile_rule(cfg, kind)[0]


def compile_scope_for(cfg: TrainConfig) -> str:
    """``--compile_scope auto``'s scope (:func:`_scope_rule`)."""
    return _scope_rule(cfg)[0]


def compile_reason(asked: TrainConfig, resolved: TrainConfig, kind: str) -> str:
    """Why ``resolved`` compiles what it does, in a line for ``--dry_run`` and the run's log:
    ``asked`` is the configuration before :func:`hydra_train.config.resolve_config` (None where
    the user said nothing)."""
    if asked.compile is not None:
        said = "--compile" if asked.compile else "--no-compile"
        return f"{said} given" + (f", scope {resolved.compile_scope}" if resolved.compile else "")
    on, why = _compile_rule(resolved, kind)
    if not on:
        return why
    scope = resolved.compile_scope
    if asked.compile_scope != "auto":
        return f"{why}; scope {scope} given"
    return f"{why}; scope {scope} ({_scope_rule(resolved)[1]})"
