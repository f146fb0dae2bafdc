"""Short training runs through hydra-train's own loop (:func:`hydra_train.run.run_training`), used by
``eval sanity``, ``analyze scaling`` and ``sweep knobs``.

Each run writes its checkpoints and metrics database into a folder of its own (a temporary one
unless the caller keeps it), on the synthetic bigram data unless a dataset is named. Settings are
split between hydra-train's :class:`TrainConfig` (``lr``, ``batch_size``, ``warmup_steps`` …) and
the model's HydraConfig (``mod_capacity``, ``recursions_per_block`` …) by field name.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hydra_diag.output import DiagError, Progress, no_progress
from hydra_train.callbacks import TrainerCallback

if TYPE_CHECKING:
    from hydra_model import GPTConfig, HydraConfig


def train_fields() -> set[str]:
    from hydra_train.config import TrainConfig

    return set(TrainConfig.field_names())


def model_fields() -> set[str]:
    from hydra_model import HydraConfig

    return set(HydraConfig.field_names())


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainConfig fields, HydraConfig overrides); a name in neither is a DiagError listing both."""
    tf, mf = train_fields(), model_fields()
    train, model = {}, {}
    for k, v in settings.items():
        if k in tf and k not in ("model_overrides",):
            train[k] = v
        elif k in mf:
            model[k] = v
        else:
            raise DiagError(
                f"unknown setting {k!r}: not a hydra-train TrainConfig field ({', '.join(sorted(tf))}) "
                f"nor a HydraConfig field ({', '.join(sorted(mf))})"
            )
    return train, model


class ProgressForward(TrainerCallback):
    """Forwards hydra-train's log rows to a diag progress callback."""

    name = "hydra_diag_progress"

    def __init__(self, progress: Progress, label: str, total: int):
        self.progress, self.label, self.total = progress, label, total

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.progress(f"{self.label}: step {step}/{self.total}, loss {row['loss']:.4f}")


def run_short_training(
    *,
    model_size: str,
    steps: int,
    settings: dict[str, Any] | None = None,
    dataset: str = "synthetic",
    vocab_size: int = 512,
    seq_len: int = 64,
    batch_size: int = 8,
    device: str = "auto",
    seed: int = 1337,
    out_dir: str | Path | None = None,
    label: str = "run",
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Train ``model_size`` (with ``settings``) for ``steps`` steps; hydra-train's summary plus the
    model's executed FLOPs per token and the folder the run wrote (None when it was temporary)."""
    from hydra_diag.synthetic import write_bigram_dataset
    from hydra_model import flops_per_token
    from hydra_train.config import TrainConfig
    from hydra_train.errors import HydraTrainError
    from hydra_train.run import run_training

    train_set, model_set = split_settings(dict(settings or {}))
    keep = out_dir is not None
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="hydra_diag_run_")
    root = Path(out_dir) if keep else Path(tmp.name)
    try:
        if dataset == "synthetic":
            n_train = max(20000, steps * batch_size * (seq_len + 1) // 2)
            data_path = str(
                write_bigram_dataset(root / "data", vocab_size, n_train, max(4000, n_train // 10))
            )
            vocab = vocab_size
        else:
            data_path, vocab = dataset, train_set.pop("vocab_size", None)
        base: dict[str, Any] = dict(
            model_size=model_size,
            dataset=data_path,
            vocab_size=vocab,
            seq_len=seq_len,
            batch_size=batch_size,
            max_steps=steps,
            log_every=max(1, min(10, steps // 5)),
            eval_every=steps,
            eval_batches=4,
            save_every=0,
            checkpoint_dir=str(root / "checkpoints"),
            device=device,
            seed=seed,
            experimental_prefetch_threads=0,
            progress=False,
            cpu_threads=torch.get_num_threads(),  # keep the caller's thread count (hydra-train would pick)
            warmup_steps=max(1, steps // 10),
            model_overrides={"max_seq_len": max(seq_len, 64), **model_set},
        )
        base.update(train_set)
        cfg = TrainConfig(**base)
        quiet = _quiet_console()
        cb = ProgressForward(progress, label, steps)
        try:
            summary = run_training(cfg, callbacks=[cb], console=quiet)
        except HydraTrainError as exc:
            raise DiagError(f"{label}: {exc}") from None
        mcfg = run_model_config(summary)
        summary["flops_per_token"] = flops_per_token(mcfg, cfg.seq_len, executed=True)
        summary["flops_per_token_dense"] = flops_per_token(mcfg, cfg.seq_len, executed=False)
        summary["train_flops"] = summary["flops_per_token"] * summary["tokens_seen"]
        summary["settings"] = dict(settings or {})
        summary["kept_in"] = str(root) if keep else None
        return summary
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_model_config(summary: dict[str, Any]) -> HydraConfig | GPTConfig:
    """The config (HydraConfig or GPTConfig, by the run's ``arch``) of the model the run trained, as
    hydra-train recorded it in its metrics database."""
    from hydra_diag.run_db import load_run

    cfg = load_run(summary["database"], summary["run_id"]).architecture_config()
    if cfg is None:
        raise DiagError(f"{summary['database']} has no model {summary['model_id']!r}")
    return cfg


def _quiet_console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=120)
