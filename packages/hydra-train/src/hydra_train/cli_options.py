"""The options of ``hydra-train run`` and ``hydra-train pretest``, made from the configuration's
fields (:mod:`hydra_train.config_options`: each field declares its flag, metavar and help once).

:func:`config_command` gives a command every field its ``CliSpec`` lists it for, parses them into
one :class:`hydra_train.config.TrainConfig` and hands the command that object: no option is
copied argument by argument. Each flag takes the seeds' underscore spelling and Typer's kebab-case
(``opt`` from cli_support); booleans that default on (``switch``) also take ``--no-...`` in both
spellings (``--no-experimental_fa3``, ``--no-experimental-fa3``). No
``from __future__ import annotations`` here: Typer reads these annotations at run time.
"""

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.markup import escape

from hydra_kernels.cli_support import AssignmentError, fail, opt, parse_assignments
from hydra_train.config_options import SECTIONS, CliSpec


def switch(name: str, help: str):
    """A boolean flag with its ``--no-`` form, in both spellings (one where they are the same
    word: --help listed ``--compile, --compile, --no-compile, --no-compile``)."""
    kebab = name.replace("_", "-")
    spellings = dict.fromkeys((f"--{kebab}/--no-{kebab}", f"--{name}/--no-{name}"))
    return typer.Option(*spellings, help=help)


def parse_model_overrides(items: list[str] | None) -> dict[str, Any]:
    """``--model_override FIELD=VALUE`` items as a dict; an item without ``=`` is a usage error."""
    try:
        return parse_assignments(items)
    except AssignmentError as exc:
        fail(f"--model_override {exc.item!r}: expected FIELD=VALUE, e.g. dim=128", code=2)


#: fields whose command-line form is parsed into the stored value
CONVERTERS: dict[str, Callable[[Any], Any]] = {"model_overrides": parse_model_overrides}


def _typer_option(spec: CliSpec, help: str) -> Any:
    # --help renders rich markup: unescaped, "no full [tokens, vocab] logits" lost its brackets
    help = escape(help)
    if spec.switch:
        return switch(spec.flags[0].removeprefix("--"), help)
    return opt(*spec.flags, help=help, **({"metavar": spec.metavar} if spec.metavar else {}))


def config_parameters(
    command: str, defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None
) -> list[inspect.Parameter]:
    """One keyword parameter per configuration field that ``command`` takes, in section order;
    ``defaults``/``helps`` replace a field's for this command only."""
    defaults, helps = defaults or {}, helps or {}
    params = []
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("cli")
            if spec is None or command not in spec.commands:
                continue
            kind = spec.cli_type if spec.cli_type is not None else hints[f.name]
            default = None if spec.cli_type is not None else f.default
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=defaults.get(f.name, default),
                    annotation=Annotated[kind, _typer_option(spec, helps.get(f.name, spec.help))],
                )
            )
    return params


def config_command(
    command: str, *, defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command function that has a ``cfg`` parameter: the command line gets the
    configuration options of ``command`` before the function's own, and the function receives
    ``cfg``, the :class:`hydra_train.config.TrainConfig` they make."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != "cfg"
        ]
        fields = config_parameters(command, defaults, helps)
        names = [p.name for p in fields]

        @functools.wraps(func)
        def run_command(**kwargs: Any) -> Any:
            from hydra_train.config import TrainConfig

            values = {n: kwargs.pop(n) for n in names}
            for name, convert in CONVERTERS.items():
                if name in values:
                    values[name] = convert(values[name])
            return func(cfg=TrainConfig(**values), **kwargs)

        run_command.__signature__ = sig.replace(parameters=[*fields, *own])
        return run_command

    return decorate


Debug = Annotated[bool, opt("--debug", help="On an error, show the full traceback, not one line.")]
