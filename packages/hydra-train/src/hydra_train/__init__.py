"""hydra_train: Train HYDRA models: hydra-train run, pretests, metrics database.

The names below load on first use, so that ``hydra-train --help`` does not import torch.
"""

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "hydra_train.config",
    "resolve_config": "hydra_train.config",
    "Trainer": "hydra_train.trainer",
    "StepResult": "hydra_train.step",
    "TrainerCallback": "hydra_train.callbacks",
    "CallbackList": "hydra_train.callbacks",
    "StepMetrics": "hydra_train.callbacks",
    "TrainingDB": "hydra_train.metrics_db",
    "rebuild_database": "hydra_train.metrics_db",
    "run_training": "hydra_train.run",
    "write_token_shard": "hydra_train.shards",
    "open_shard": "hydra_train.shards",
    "load_data": "hydra_train.data_sources",
    "HydraTrainError": "hydra_train.errors",
    "HydraDataError": "hydra_train.errors",
    "HydraCheckpointError": "hydra_train.errors",
    "SafeOptimizations": "hydra_train.safe_opts.callback",
    "PretestHook": "hydra_train.safe_opts.pretest_log",
    "FaultInjector": "hydra_train.safe_opts.faults",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hydra_train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
