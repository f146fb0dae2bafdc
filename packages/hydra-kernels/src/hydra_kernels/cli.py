"""The `hydra-kernels` command line: status, check, bench.

torch and the kernels are imported inside the commands, so ``--help`` stays fast.
"""

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from hydra_kernels import __version__
from hydra_kernels.cli_format import compact_table
from hydra_kernels.cli_reports import render_bench_report, render_check_results
from hydra_kernels.cli_support import (
    EXIT_USAGE,
    add_version_option,
    console,
    emit_json,
    err_console,
    fail,
    new_app,
    reflowed,
    require_cuda,
)
from hydra_kernels.registry import OP_ALIASES, OP_SPECS, canonical_op

app = new_app("Fused Triton kernels for HYDRA: status, numerical checks, benchmarks.")
add_version_option(app, "hydra-kernels", __version__)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]

_OP_MODULES = {spec.name: spec.module for spec in OP_SPECS}
_CHECK_NAMES = [check.name for spec in OP_SPECS for check in spec.checks]
_BENCH_NAMES = [name for spec in OP_SPECS for name in spec.bench]
_SWEEP_NAMES = [spec.name for spec in OP_SPECS if spec.sweep]
#: checks.MAX_SEED, here because checks imports every op's module, which --help does without
#: (test_cli_help_80 keeps the two equal, and _CHECK_NAMES equal to checks.CHECK_NAMES)
_MAX_SEED = 2**32 - 1
#: "linear_ce for linear_cross_entropy": both commands take the old spellings too
_ALIASES = ", ".join(f"{alias} for {name}" for alias, name in OP_ALIASES.items())


def _either(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def resolved_launch_configs(device: Any) -> dict[str, dict[str, Any]]:
    """Each op's launch tables, resolved for ``device``: ``{op: {table: config}}``.

    A table is a module-level ``{generation: LaunchConfig}`` mapping, or a tuple of
    ``(max_width, {generation: LaunchConfig})`` rows for ops whose launch depends on the row
    width (then the config is given per width bucket). Tables are looked up in the op's module
    and in the private ``hydra_kernels.ops`` modules it takes functions from; a private module's
    table that the op's module re-exports is listed once, by its name there. Overrides set for
    the op's name (and the environment's) are applied.
    """
    import dataclasses
    import importlib
    import types
    from collections.abc import Mapping

    from hydra_kernels.launch_config import LaunchConfig, resolve_launch_config

    def is_gen_table(v: Any) -> bool:
        return (
            isinstance(v, Mapping) and "default" in v and all(isinstance(c, LaunchConfig) for c in v.values())
        )

    def is_width_table(v: Any) -> bool:
        return (
            isinstance(v, tuple)
            and bool(v)
            and all(isinstance(r, tuple) and len(r) == 2 and is_gen_table(r[1]) for r in v)
        )

    out: dict[str, dict[str, Any]] = {}
    for op, mod_name in _OP_MODULES.items():
        main = importlib.import_module(mod_name)
        helpers = {
            getattr(v, "__module__", None) if not isinstance(v, types.ModuleType) else v.__name__
            for v in vars(main).values()
        }
        modules = [main] + [
            importlib.import_module(m)
            for m in sorted(h for h in helpers if isinstance(h, str) and h.startswith("hydra_kernels.ops._"))
        ]
        tables: dict[str, Any] = {}
        listed: set[int] = set()  # ids of the tables already in ``tables``
        for mod in modules:
            prefix = "" if mod is main else mod.__name__.rsplit(".", 1)[1] + "."
            for name, value in vars(mod).items():
                if name.startswith("__") or id(value) in listed:
                    continue
                if is_gen_table(value):
                    tables[prefix + name] = dataclasses.asdict(resolve_launch_config(op, device, value))
                elif is_width_table(value):
                    tables[prefix + name] = {
                        f"<= {width}": dataclasses.asdict(resolve_launch_config(op, device, table))
                        for width, table in value
                    }
                else:
                    continue
                listed.add(id(value))
        out[op] = tables
    return out


@app.command()
@reflowed
def status(json_output: JsonFlag = False) -> None:
    """Show Triton availability, the switches, and per op what runs on this machine's device
    (backend, fused backward, fallbacks) with its launch configuration."""
    import torch
    from rich.text import Text

    from hydra_kernels.controls import get_kernel_status

    st = get_kernel_status()
    st["launch"] = resolved_launch_configs(torch.device(st["device"]))
    if json_output:
        emit_json(st)
        return
    triton = st["triton_version"] if st["triton_available"] else f"missing ({st['triton_import_error']})"
    arch = f", sm_{st['compute_capability'].replace('.', '')}" if st["compute_capability"] else ""
    console.print(
        f"triton {triton}; kernels switched {'on' if st['use_triton_kernels'] else 'off'}; "
        f"interpreter {'on' if st['interpreter'] else 'off'}; device {st['device']} "
        f"({st['device_name']}{arch})"
    )
    fast = st["fast_launch"]
    why = f" ({fast['error']})" if fast["error"] else ""
    console.print(
        f"direct launches of compiled kernels (HYDRA_FAST_LAUNCH): {'on' if fast['enabled'] else 'off'}{why}"
    )
    # two-line headers: at 80 columns the cells keep their width ("reference" whole)
    headers = ("enabled", "fused\nbackward", "backend", "backward\nbackend", "fall-\nbacks", "last\nerror")
    ops = compact_table("ops", "op", headers)
    for op, s in st["ops"].items():
        ops.add_row(
            op,
            "yes" if s["enabled"] else "no",
            "yes" if s["backward_enabled"] else "no",
            s["backend"],
            s["backward_backend"],
            str(s["fallbacks"]),
            Text(s["last_error"] or ""),  # a Text: an exception's "[...]" is not read as markup
        )
    console.print(ops)
    fields = ("num_warps", "num_stages", "block_rows", "block_q", "block_kv")
    headers = tuple(f.replace("_", "\n", 1) for f in fields)  # num_warps -> num / warps
    # the table names run to 29 characters (_linear_ce_kernels.ROW_LAUNCH): they wrap, the numbers not
    launch = compact_table(
        f"launch configurations on {st['device']}", "op", ("table", "width", *headers), fold=("table",)
    )
    for op, tables in st["launch"].items():
        if not tables:
            launch.add_row(op, "-", "", "", "", "", "", "")
        for name, cfg in tables.items():
            rows = cfg.items() if "num_warps" not in cfg else [("", cfg)]
            for width, c in rows:
                launch.add_row(op, name, width, *(str(c[k]) for k in fields))
    console.print(launch)


@app.command()
@reflowed
def check(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Small shapes only (fast, also on the CPU); default: the full shapes."),
    ] = False,
    op: Annotated[
        list[str] | None,
        typer.Option(
            "--op",
            metavar="OP",
            help=f"Check only {_either(_CHECK_NAMES)} (repeatable; {_ALIASES} too); default: every op.",
        ),
    ] = None,
    dtype: Annotated[
        list[str] | None,
        typer.Option(
            "--dtype", metavar="DTYPE", help="fp32, bf16 or fp16 (repeatable); default: fp32 and bf16."
        ),
    ] = None,
    seed: Annotated[
        int | None,
        # the range up front: torch's generator answered a larger seed with "Overflow when
        # unpacking long long", naming no option
        typer.Option(
            "--seed", metavar="N", min=0, max=_MAX_SEED, help="Fix the inputs (default: fresh random)."
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Check every op, forward and backward, on this device (CUDA if present, else the CPU)
    against a float64 reference; exit 1 if any output or gradient fails the criterion."""
    from rich.progress import Progress

    from hydra_kernels import checks

    # before the progress bar, whose stop left a blank line above the error; worded as bench's
    unknown = [o for o in op or () if canonical_op(o) not in checks.CHECK_NAMES]
    if unknown:
        fail(f"unknown --op {', '.join(unknown)}; choose from {', '.join(checks.CHECK_NAMES)}", EXIT_USAGE)
    bad = [d for d in dtype or () if d not in checks.DTYPES]
    if bad:
        fail(f"unknown --dtype {', '.join(bad)}; choose from {', '.join(checks.DTYPES)}", EXIT_USAGE)
    device = checks.default_device()
    mode = checks.check_mode(device)
    try:
        with Progress(console=err_console, transient=True, disable=json_output) as bar:
            task = bar.add_task("checking", total=None)
            results = checks.run_checks(
                quick=quick,
                ops=op,
                dtypes=dtype or ("fp32", "bf16"),
                device=device,
                seed=seed,
                progress=lambda msg: bar.update(task, description=f"checking {msg}"),
            )
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    failed = [r for r in results if not r.passed]
    if json_output:
        emit_json(
            {
                "device": str(device),
                "mode": mode,
                "passed": not failed,
                "results": [r.as_dict() for r in results],
            }
        )
    else:
        render_check_results(results, mode, console)
    if failed:
        err_console.print(f"{len(failed)} of {len(results)} checks failed")
        raise typer.Exit(1)


@app.command()
@reflowed
def bench(
    op: Annotated[
        list[str] | None,
        typer.Option(
            "--op",
            metavar="OP",
            help=f"Time only {_either(_BENCH_NAMES)} (repeatable; {_ALIASES} too); default: every op.",
        ),
    ] = None,
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help=f"Instead: time only hydra's {'/'.join(_SWEEP_NAMES)} under a grid of launch configs.",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", metavar="PATH", help="Write the full JSON report here (default: not written)."),
    ] = None,
    rep: Annotated[
        int, typer.Option("--rep", metavar="MS", min=10, help="do_bench repetition time per figure, ms.")
    ] = 100,
    json_output: JsonFlag = False,
) -> None:
    """Time each op × shape, forward+backward, against torch eager, torch.compile and Liger-Kernel
    (when importable): ms, GB/s over the byte floor, % of the measured copy bandwidth. CUDA only.

    --out PATH also writes the full JSON report there."""
    from hydra_kernels.bench import BENCH_OPS, SWEEP_CONFIGS

    op = [canonical_op(o) for o in op or ()] or None
    unknown = [o for o in op or () if o not in BENCH_OPS]
    if unknown:
        fail(f"unknown --op {', '.join(unknown)}; choose from {', '.join(BENCH_OPS)}", EXIT_USAGE)
    if sweep and op and not set(op) & set(SWEEP_CONFIGS):
        fail(f"--sweep covers {' and '.join(SWEEP_CONFIGS)}; none of them is among --op", EXIT_USAGE)
    require_cuda("hydra-kernels bench")
    from hydra_kernels.bench import run_bench
    from hydra_kernels.bench_harness import write_report

    started = time.perf_counter()

    def log(msg: str) -> None:  # one line per step where no terminal shows a spinner (logs)
        err_console.print(f"[{time.perf_counter() - started:6.1f}s] {msg}", highlight=False)

    if err_console.is_terminal:
        with err_console.status("benchmarking") as spinner:
            report = run_bench(ops=op, sweep=sweep, rep=rep, progress=lambda m: spinner.update(m))
    else:
        report = run_bench(ops=op, sweep=sweep, rep=rep, progress=log)
    report["command"] = "hydra-kernels bench " + " ".join(
        [*(f"--op {o}" for o in op or ()), *(["--sweep"] if sweep else []), f"--rep {rep}"]
    )
    if out:
        write_report(report, Path(out))
    if json_output:
        emit_json(report)
    else:
        render_bench_report(report, console)
        if out:
            console.print(f"JSON report: {out}")
