"""The automatic values of a run's configuration, per device kind and mode, in one table that
:func:`hydra_train.config.resolve_config` fills the fields from and the options' ``--help`` is
written from (:func:`device_default`): the help cannot drift from what a run uses.

No imports from hydra_train here: :mod:`hydra_train.config_options` (the flags) reads it.
"""

from __future__ import annotations

from typing import Any

# Per device kind: (dataset, vocab, seq_len, batch, steps, lr, eval_every, log_every, save_every).
# The CPU row is sized so that the default run (tiny preset, the stdlib corpus) finishes in a few
# minutes on a 2-core machine with the validation loss far below its start; see the README.
TESTING_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(
        dataset="stdlib",
        vocab_size=4096,
        seq_len=128,
        batch_size=8,
        max_steps=120,
        lr=3e-3,
        eval_every=40,
        log_every=5,
        save_every=60,
    ),
    "cuda": dict(
        dataset="stdlib-full",
        vocab_size=32000,
        seq_len=1024,
        batch_size=16,
        max_steps=300,
        lr=1e-3,
        eval_every=100,
        log_every=10,
        save_every=300,
    ),
}
#: --mode production replaces these (the others stay as in testing mode)
PRODUCTION_DEFAULTS: dict[str, Any] = dict(max_steps=100_000, eval_every=1000, log_every=50, save_every=1000)
LR_BY_SIZE = {"tiny": 3e-3, "debug": 1e-3, "100M": 6e-4, "250M": 5e-4, "500M": 4e-4, "1B": 3e-4}


def device_default(name: str) -> str:
    """What ``--help`` says a field left unset becomes, e.g. ``default: 8 on the CPU, 16 on CUDA``
    or, for a field --mode production changes, ``default: testing mode 40 on the CPU, 100 on
    CUDA; production 1000``."""
    cpu, cuda = TESTING_DEFAULTS["cpu"][name], TESTING_DEFAULTS["cuda"][name]
    if name not in PRODUCTION_DEFAULTS:
        return f"default: {cpu} on the CPU, {cuda} on CUDA"
    return f"default: testing mode {cpu} on the CPU, {cuda} on CUDA; production {PRODUCTION_DEFAULTS[name]}"
