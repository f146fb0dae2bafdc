"""``hydra-train pretest``: SafeOptimizations' pretests without training, their history, and
OPTIMIZATIONS.md. Registered on the app in :mod:`hydra_train.cli`.

No ``from __future__ import annotations`` here: Typer reads these annotations at run time.
"""

import sys
from pathlib import Path
from typing import Annotated

from hydra_kernels.cli_support import EXIT_USAGE, console, emit_json, err_console, fail, opt, reflowed
from hydra_train.cli_options import config_command
from hydra_train.config import TrainConfig
from hydra_train.safe_opts.report import reference_of

P = {
    "dataset": "random (default: random tokens, no corpus needed) or any --dataset of hydra-train run.",
    "all": "Request every optimization (fp8, compile, 8bit_adam, triton_kernels, static routing too).",
    "only": "Comma-separated optimizations to pretest, e.g. fa3,compile (default: all requested).",
    "history": "Summarise the pretest logs in --log_dir instead of running.",
    "report": "Write OPTIMIZATIONS.md (validation tables, speedups) from the logs in --log_dir to this path.",
    "speedup_size": "--report: the model size whose speedups are tabulated.",
    "log_dir": "Pretest logs (default: <checkpoint_dir>/pretest_logs).",
    "json_out": "Print the record (or the history summary) as JSON.",
    "arm_timeout": "Fail an optimization whose arm (compilation included) takes more than this many seconds.",
}


def _show(rec: dict) -> None:
    """The pretest record: a table, or at a narrow width (80 columns) one block per optimization
    (hydra_kernels' print_records: an optimization's name or a number is never cut)."""
    from rich.markup import escape

    from hydra_kernels.cli_format import print_records

    env = rec.get("env") or {}
    b = rec.get("batch") or ["?", "?"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    rows = []
    for key, r in (rec.get("results") or {}).items():
        tm, nm = r.get("timing") or {}, r.get("numerics") or {}
        ge = "-" if nm.get("grad_err") is None else f"{nm['grad_err']:.3g} ({nm['grad_bound']:.3g})"
        rows.append(
            {
                "optimization": key,
                "result": r["status"],
                "reason": (r.get("reason") or "")[:90],
                "ms/step": f(tm.get("median_ms"), ".2f"),
                "reference": reference_of(key, r),
                "ref ms/step": f(tm.get("default_median_ms"), ".2f"),
                "speedup": f(tm.get("speedup"), ".3f") + ("" if tm.get("judged", True) else " (not judged)"),
                "grad err (bound)": ge,
            }
        )
    title = (
        f"pretests: {rec['model_size']} on {env.get('device')}, batch {b[0]} × {b[1]}, {rec.get('precision')}"
    )
    columns = list(rows[0]) if rows else ["optimization", "result"]
    # literal cells: a reason's "[...]" is not rich markup
    print_records(console, title, rows, columns, fmt=lambda v: "-" if v is None else escape(str(v)))
    console.print(
        f"log: {rec.get('log_file')}  ({rec.get('wall_s', 0):.0f} s)", highlight=False, markup=False
    )


@reflowed
@config_command("pretest", defaults={"dataset": "random"}, helps={"dataset": P["dataset"]})
def pretest(
    cfg: TrainConfig,
    arm_timeout: Annotated[float | None, opt("--pretest_arm_timeout", help=P["arm_timeout"])] = None,
    all_opts: Annotated[bool, opt("--all", help=P["all"])] = False,
    only: Annotated[str | None, opt("--only", help=P["only"])] = None,
    history: Annotated[bool, opt("--history", help=P["history"])] = False,
    report: Annotated[Path | None, opt("--report", help=P["report"])] = None,
    speedup_size: Annotated[str, opt("--speedup_model_size", help=P["speedup_size"])] = "100M",
    log_dir: Annotated[str | None, opt("--log_dir", help=P["log_dir"])] = None,
    json_out: Annotated[bool, opt("--json", help=P["json_out"])] = False,
) -> None:
    """Run SafeOptimizations' pretests alone, on the model `hydra-train run` would build.

    With the same flags as run: each requested optimization against the safe default from the same
    weights and batches (runs, finite, matches within the stated tolerance, not slower). Prints
    PASS / FAIL reason / N/A per optimization and appends to the pretest logs.

    --history summarises the logs; --report writes OPTIMIZATIONS.md from them."""
    from hydra_train.errors import HydraTrainError, HydraUsageError
    from hydra_train.safe_opts.pretest_log import PretestHook
    from hydra_train.safe_opts.registry import NAMES

    logs = log_dir or str(Path(cfg.runtime.checkpoint_dir) / "pretest_logs")
    hook = PretestHook(logs)
    if history:
        if json_out:  # emit_json writes a non-finite number (a failed arm's) as null
            return emit_json(hook.get_summary())
        return hook.print_summary(console)
    if report is not None:
        from hydra_train.safe_opts.report import build_report

        try:
            text = build_report(
                hook.get_history(),
                speedup_size=speedup_size,
                command=f"hydra-train pretest --report {report} --log_dir {logs}",
            )
        except ValueError as exc:
            fail(f"{exc} (looked in {hook.history_path})")
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text)
        console.print(
            f"wrote {report} from {len(hook.get_history())} pretest records in {logs}", highlight=False
        )
        return
    names = [n.strip() for n in only.split(",")] if only else None
    for n in names or []:
        if n not in NAMES:
            fail(f"--only: unknown optimization {n!r}; choose from {', '.join(NAMES)}", code=2)
    from hydra_train.safe_opts.standalone import request_all, run_standalone

    cfg = cfg.replace(progress=False)
    if all_opts:
        cfg = request_all(cfg)
    say = (
        (lambda m: err_console.print(m, highlight=False))
        if json_out
        else (lambda m: console.print(m, style="dim", highlight=False, markup=False))
    )
    try:
        rec = run_standalone(cfg, only=names, log_dir=logs, log=say, arm_timeout_s=arm_timeout)
    except HydraUsageError as exc:  # a flag's value (--model_size 7B): exit 2, as run does
        fail(str(exc), code=EXIT_USAGE)
    except HydraTrainError as exc:
        fail(str(exc))
    if json_out:
        return emit_json(rec)
    _show(rec)
    sys.stdout.flush()
