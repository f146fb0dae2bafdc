"""hydra_train's process-wide options, in one explicit object (:class:`TrainOptions`).

Everything hydra-train takes from the environment rather than from a flag is a field of
:class:`TrainOptions`, and this module is the only one that reads ``os.environ``. The rest of the
package asks :func:`train_options` for the options in force; two kinds of thin entry point fill
them, and code wins:

* :func:`set_train_options` (``set_train_options(cache_dir=tmp, mem_dump_every=50)``) sets fields
  from code; :func:`reset_train_options` hands them back to the environment;
* the environment variables below, read when :func:`train_options` is called (not once at import:
  hydra-train has always read them at the point of use, so a variable set after ``import
  hydra_train``, by a test or a notebook, still counts). An empty variable counts as unset.

``HYDRA_DATA_ROOT`` (``data_root``)
    the folder in which ``--dataset NAME`` finds ``NAME/``; default none (names are paths only)
``HYDRA_CACHE_DIR`` (``cache_dir``)
    where tokenizers and tokenized corpora are cached; default ``~/.cache/hydra``
``HYDRA_MEM_DUMP_EVERY`` (``mem_dump_every``)
    a CUDA memory summary into the run artifacts every N steps; default 0 (only after the model is
    built and after the first logged step)
``HYDRA_SAFEOPTS_INJECT`` (``inject_faults``)
    SafeOptimizations fault injection, in the grammar of :mod:`hydra_train.safe_opts.faults`;
    default none
``HYDRA_COMPILE_BACKEND`` (``compile_backend``)
    the ``torch.compile`` backend of ``--compile``; default ``inductor``
``HYDRA_ATTENTION_BACKEND`` (``pinned_attention_backend``)
    hydra_model's variable, by which hydra_model picks its attention backend; hydra-train reads it
    only to leave that pick alone (``--experimental_fa3`` is not applicable while it is set);
    default none
``WANDB_PROJECT`` (``wandb_project``), ``WANDB_MODE`` (``wandb_mode``)
    W&B's variables, with hydra-train's defaults for ``--wandb``: ``hydra``, ``offline``

A value that cannot be used (``HYDRA_MEM_DUMP_EVERY=ten``) raises :class:`HydraOptionsError`
naming the variable, or the field when it was set from code.

Two reads of the environment are not options: :func:`torchrun_launch` gives the variables torchrun
sets for each process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), which the distributed setup
(:mod:`hydra_train.distributed`, ``run.py``, ``cli.py``) reads through it and nowhere else
(``MASTER_ADDR``/``MASTER_PORT`` are read by torch.distributed itself); and
:func:`recorded_environment` gives the variables that ``env.json`` records (:mod:`hydra_train.artifacts`).
hydra_kernels' and hydra_model's switches are their own ``options`` modules, built alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from hydra_train.errors import HydraOptionsError


@dataclass(frozen=True)
class TrainOptions:
    """Every option hydra-train takes from the environment (see the module docstring)."""

    data_root: Path | None
    cache_dir: Path
    mem_dump_every: int
    inject_faults: str
    compile_backend: str
    pinned_attention_backend: str
    wandb_project: str
    wandb_mode: str


def _path(value: object) -> Path | None:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError("expected a path")
    text = os.fspath(value)
    return Path(text).expanduser() if text.strip() else None


def _count(value: object) -> int | None:
    """A whole number >= 0: an int from code, its digits from the environment."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if not text.isdigit():
            raise ValueError("expected a whole number >= 0")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("expected a whole number >= 0")
    return value


def _text(value: object) -> str | None:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value.strip() or None


@dataclass(frozen=True)
class Variable:
    """One environment variable: the field it fills, how its text is read, and the default."""

    name: str
    field: str
    #: the variable's text, or a value set from code -> the field's value (None: unset)
    parse: Callable[[object], object]
    default: Callable[[], object]


#: The variables, one per field of TrainOptions (the module docstring says what each means).
VARIABLES: tuple[Variable, ...] = (
    Variable("HYDRA_DATA_ROOT", "data_root", _path, lambda: None),
    Variable("HYDRA_CACHE_DIR", "cache_dir", _path, lambda: Path.home() / ".cache" / "hydra"),
    Variable("HYDRA_MEM_DUMP_EVERY", "mem_dump_every", _count, lambda: 0),
    Variable("HYDRA_SAFEOPTS_INJECT", "inject_faults", _text, lambda: ""),
    Variable("HYDRA_COMPILE_BACKEND", "compile_backend", _text, lambda: "inductor"),
    Variable("HYDRA_ATTENTION_BACKEND", "pinned_attention_backend", _text, lambda: ""),
    Variable("WANDB_PROJECT", "wandb_project", _text, lambda: "hydra"),
    Variable("WANDB_MODE", "wandb_mode", _text, lambda: "offline"),
)
_BY_FIELD = {v.field: v for v in VARIABLES}

#: fields set from code (set_train_options), already parsed; they win over the environment
_FROM_CODE: dict[str, object] = {}


def _read(var: Variable, raw: object, source: str) -> object:
    try:
        value = var.parse(raw)
    except ValueError as exc:
        raise HydraOptionsError(f"{source}: {exc}; fix it or unset it") from None
    return var.default() if value is None else value


def train_options(environ: Mapping[str, str] | None = None) -> TrainOptions:
    """The options in force: each field as set from code, else its variable in ``environ``
    (default ``os.environ``), else its default."""
    env = os.environ if environ is None else environ
    values = {}
    for var in VARIABLES:
        if var.field in _FROM_CODE:
            values[var.field] = _FROM_CODE[var.field]
        else:
            raw = env.get(var.name, "")
            values[var.field] = _read(var, raw, f"environment variable {var.name}={raw!r}")
    return TrainOptions(**values)


def set_train_options(**values: object) -> None:
    """Set fields of :class:`TrainOptions` from code; they win over the environment until
    :func:`reset_train_options`. ``None`` sets a field's default, whatever the environment says."""
    unknown = sorted(set(values) - set(_BY_FIELD))
    if unknown:
        known = ", ".join(f.name for f in fields(TrainOptions))
        raise HydraOptionsError(f"set_train_options: no option {', '.join(unknown)}; the options are {known}")
    parsed = {}
    for name, raw in values.items():
        var = _BY_FIELD[name]
        source = f"set_train_options({name}={raw!r}) ({var.name})"
        parsed[name] = var.default() if raw is None else _read(var, raw, source)
    _FROM_CODE.update(parsed)  # all or nothing: one bad value sets none


def reset_train_options(*names: str) -> None:
    """Hand the named fields (none named: every field) back to the environment."""
    for name in names or tuple(_FROM_CODE):
        if name not in _BY_FIELD:
            raise HydraOptionsError(f"reset_train_options: no option {name!r}")
        _FROM_CODE.pop(name, None)


@dataclass(frozen=True)
class TorchrunLaunch:
    """What torchrun told this process; a single process's values where it told nothing."""

    #: RANK and WORLD_SIZE are both set (torchrun sets them for every process it starts)
    launched: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def torchrun_launch(environ: Mapping[str, str] | None = None) -> TorchrunLaunch:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun set them (torch's variables, not
    options: nothing sets them from code)."""
    env = os.environ if environ is None else environ

    def number(name: str, default: int) -> int:
        raw = env.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise HydraOptionsError(
                f"environment variable {name}={raw!r} is not a whole number; torchrun sets it, "
                "so unset it when launching a single process"
            ) from None

    return TorchrunLaunch(
        launched="RANK" in env and "WORLD_SIZE" in env,
        rank=number("RANK", 0),
        world_size=number("WORLD_SIZE", 1),
        local_rank=number("LOCAL_RANK", 0),
    )


#: the prefixes of the variables a run's env.json records
RECORDED_PREFIXES = ("HYDRA_", "PYTORCH_", "CUDA_", "TORCH_", "NCCL_", "TRITON_")


def recorded_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that shape a run, for its ``env.json`` (a record, not options)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(RECORDED_PREFIXES)}
