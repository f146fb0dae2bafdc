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

from hydra_diag.output import DiagError, DiagUsageError, Progress, no_progress
from hydra_train.callbacks import TrainerCallback

if TYPE_CHECKING:
    from hydra_model import GPTConfig, HydraConfig
    from hydra_train.config import TrainConfig


def train_fields() -> set[str]:
    from hydra_train.config import TrainConfig

    return set(TrainConfig.field_names())


def model_fields() -> set[str]:
    from hydra_model import HydraConfig

    return set(HydraConfig.field_names())


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainConfig fields, HydraConfig overrides); a name in neither is a DiagUsageError listing both."""
    tf, mf = train_fields(), model_fields()
    train, model = {}, {}
    for k, v in settings.items():
        if k in tf and k not in ("model_overrides",):
            train[k] = v
        elif k in mf:
            model[k] = v
        else:
            raise DiagUsageError(
                f"unknown setting {k!r}: not a hydra-train TrainConfig field ({', '.join(sorted(tf))}) "
                f"nor a HydraConfig field ({', '.join(sorted(mf))})"
            )
    return train, model


def _field_kinds() -> dict[str, set[str]]:
    """Field name → the type names its annotation allows besides None (``"int | None"`` → {"int"}),
    for HydraConfig's and TrainConfig's fields (a name in both: TrainConfig's, where split_settings
    sends it)."""
    import dataclasses

    from hydra_model import HydraConfig
    from hydra_train.config import SECTIONS

    out: dict[str, set[str]] = {}
    for cls in (HydraConfig, *SECTIONS.values()):
        for f in dataclasses.fields(cls):
            text = getattr(f.type, "__name__", str(f.type))
            out[f.name] = {part.strip() for part in text.split("|")} - {"None"}
    return out


def check_value_types(settings: dict[str, Any], what: str) -> None:
    """A DiagUsageError when a value cannot be of its field's type (``lr=abc``): hydra-train's range
    checks would compare the text with a number and raise TypeError deep in a run."""
    kinds = _field_kinds()
    for name, value in settings.items():
        allowed = kinds.get(name, set())
        if allowed and allowed <= {"int", "float"}:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DiagUsageError(f"{what} {name}: {value!r} is not a number")
            if allowed == {"int"} and not float(value).is_integer():
                raise DiagUsageError(f"{what} {name}: {value!r} is not a whole number")
        elif allowed == {"bool"} and not isinstance(value, bool):
            raise DiagUsageError(f"{what} {name}: {value!r} is not true or false")


class ProgressForward(TrainerCallback):
    """Forwards hydra-train's log rows to a diag progress callback."""

    name = "hydra_diag_progress"

    def __init__(self, progress: Progress, label: str, total: int):
        self.progress, self.label, self.total = progress, label, total

    def on_log(self, step: int, row: dict[str, Any]) -> None:
        self.progress(f"{self.label}: step {step}/{self.total}, loss {row['loss']:.4f}")


def short_run_config(
    *,
    model_size: str,
    steps: int,
    settings: dict[str, Any] | None,
    dataset: str,
    data_path: str,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    device: str,
    seed: int,
    root: Path,
) -> TrainConfig:
    """The TrainConfig of a short run: ``data_path`` holds the data (the synthetic stream written
    there, or ``dataset`` itself), ``root`` the run's checkpoints and database."""
    from hydra_train.config import TrainConfig

    train_set, model_set = split_settings(dict(settings or {}))
    vocab = vocab_size if dataset == "synthetic" else train_set.pop("vocab_size", None)
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
    return TrainConfig(**base)


def check_short_run(what: str, **run: Any) -> None:
    """Refuse, before any run trains, settings whose values alone are wrong (a preset that does not
    exist, ``lr=-1``, a model field the config refuses): the checks hydra-train makes when a run
    starts (:func:`hydra_train.config.resolve_config`), as a DiagUsageError whose message begins
    with ``what`` (the flag that gave them, when given). Call :func:`check_value_types` first: those
    checks compare values with numbers. ``run``: :func:`short_run_config`'s arguments but
    ``data_path`` and ``root``. What the device or the data decide is left to the run itself."""
    from hydra_train.config import DeviceInfo, resolve_config
    from hydra_train.errors import HydraUsageError

    # a named corpus (stdlib, pyenv) stays named: resolve_config holds its vocabulary to the BPE
    # minimum; the synthetic stream's folder does not exist yet and decides nothing here
    dataset = run.get("dataset", "synthetic")
    data_path = "unused" if dataset == "synthetic" else dataset
    cfg = short_run_config(data_path=data_path, root=Path("unused"), **run)
    cuda = torch.cuda.is_available() and run.get("device") != "cpu"
    try:
        resolve_config(cfg, DeviceInfo("cuda", 80.0, True) if cuda else DeviceInfo("cpu"))
    except HydraUsageError as exc:
        raise DiagUsageError(f"{what}: {exc}" if what else str(exc)) from None


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
    from hydra_train.errors import HydraTrainError
    from hydra_train.run import run_training

    split_settings(dict(settings or {}))  # an unknown name before any file is written
    keep = out_dir is not None
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="hydra_diag_run_")
    root = Path(out_dir) if keep else Path(tmp.name)
    try:
        if dataset == "synthetic":
            n_train = max(20000, steps * batch_size * (seq_len + 1) // 2)
            data_path = str(
                write_bigram_dataset(root / "data", vocab_size, n_train, max(4000, n_train // 10))
            )
        else:
            data_path = dataset
        cfg = short_run_config(
            model_size=model_size,
            steps=steps,
            settings=settings,
            dataset=dataset,
            data_path=data_path,
            vocab_size=vocab_size,
            seq_len=seq_len,
            batch_size=batch_size,
            device=device,
            seed=seed,
            root=root,
        )
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
