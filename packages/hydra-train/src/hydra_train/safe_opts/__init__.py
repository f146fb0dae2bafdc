"""SafeOptimizations: every optional optimization pretested, monitored and switched off for real.

Modules, one concept each:

==============  ===============================================================================
registry        the :class:`Optimization` interface, status words, the nine optimizations' order
toggles         fa3, static_routing, blackwell_tuning, prefetch_threads, triton_kernels, compile
cuda_graphs     switches the trainer's CUDA-graphed step (hydra_train.graphed_step) on and off
fp8             FP8 forward GEMMs for the linear layers (bf16 backward, bf16 master weights)
adam8bit        bitsandbytes AdamW8bit with the optimizer state carried over both ways
tolerances      what "matches the safe default" and "not slower" mean, and why
pretest         running the pretest arms (same weights, same batches) and their verdicts
pretest_arms    which arms run, in two phases (compile last, on top of what it traces)
pretest_log     PretestHook: rerun rule (fingerprint), logs, history, summary
activation      applying them to a built run: safe defaults, pretests, activation in order
monitor         anomaly detectors and the sync-free per-step readback
attribution     safety windows, blame, isolation trials, graduation
callback        SafeOptimizations, the callback that watches them and carries out the decisions
faults          fault injection tied to one optimization (tests; wraps the step only when asked)
standalone      ``hydra-train pretest``: the pretests without training
report          OPTIMIZATIONS.md from the logs
==============  ===============================================================================
"""

from typing import Any

_EXPORTS = {
    "SafeOptimizations": "hydra_train.safe_opts.callback",
    "PretestHook": "hydra_train.safe_opts.pretest_log",
    "PretestRunner": "hydra_train.safe_opts.pretest",
    "PretestSettings": "hydra_train.safe_opts.pretest",
    "FaultInjector": "hydra_train.safe_opts.faults",
    "Optimization": "hydra_train.safe_opts.registry",
    "build_registry": "hydra_train.safe_opts.registry",
    "build_report": "hydra_train.safe_opts.report",
    "run_standalone": "hydra_train.safe_opts.standalone",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hydra_train.safe_opts' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
