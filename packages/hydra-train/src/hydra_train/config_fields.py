"""How a configuration field declares its command-line flag: :func:`flag` and :class:`CliSpec`
(used by :mod:`hydra_train.config_options` and :mod:`hydra_train.config_optimizations`, read by
:mod:`hydra_train.cli_options`). No torch and no Typer here: ``--help`` stays fast."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

RUN, PRETEST = "run", "pretest"
BOTH = (RUN, PRETEST)


@dataclass(frozen=True)
class CliSpec:
    """How a field appears on the command line."""

    flags: tuple[str, ...]  # underscore spellings; the kebab ones are added (cli_support.opt)
    help: str
    metavar: str | None = None
    switch: bool = False  # a boolean with its --no- form
    commands: tuple[str, ...] = BOTH
    #: the type the command line parses, when not the field's own (``--model_override``: a list)
    cli_type: Any = None


def flag(default: Any = dataclasses.MISSING, *flags: str, help: str, factory: Any = None, **cli: Any) -> Any:
    """A field with its CLI flag (``switch=True``, ``metavar=``, ``commands=``, ``cli_type=``)."""
    meta = {"cli": CliSpec(tuple(flags), help, **cli)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
