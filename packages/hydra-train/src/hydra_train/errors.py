"""Errors the CLI turns into one line on stderr and exit status 1 (never a deep stack trace)."""


class HydraTrainError(RuntimeError):
    """Base class: something the user can fix (bad data, bad checkpoint, bad flag combination)."""


class HydraUsageError(HydraTrainError):
    """A flag value out of range (not finite, negative, zero where it must be positive): exit 2."""


class HydraOptionsError(HydraTrainError, ValueError):
    """An option of :mod:`hydra_train.options` with a value that cannot be used; the message names
    its environment variable (or the field, when set from code)."""


class HydraDivergedError(HydraTrainError):
    """Training produced non-finite loss, gradients or weights; the run stops as ``failed``."""


class HydraDataError(HydraTrainError):
    """A dataset, shard or tokenizer that cannot be used; the message names the file and the problem."""


class HydraCheckpointError(HydraTrainError):
    """A checkpoint that cannot be resumed from (unreadable, or saved for another model config)."""


def short_error(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (for one-line errors)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    out = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."
