"""What ``hydra-kernels check`` and ``bench`` print for people: the check's table (80 columns
whole) and the bench report's tables. Nothing here imports torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hydra_kernels.cli_format import compact_table

CHECK_TITLE = "|kernel − ref64| ≤ 2·|torch − ref64| + atol (worst ratio ≤ 1 passes)"


def ratio_cell(ratio: float | None) -> str:
    """A worst ratio in at most 5 characters, its header's width (``worst``/``ratio``): 3 decimals
    below 10 (where the verdict is decided), whole numbers up to 99999, then as ``1e+05``. A failing
    ratio of 123456.789 printed whole took the width the result column needs at 80 columns."""
    if ratio is None:
        return "-"
    if not math.isfinite(ratio) or round(ratio, 3) < 10:
        return f"{ratio:.3f}"  # also inf and nan
    if round(ratio) < 100_000:
        return f"{ratio:.0f}"
    return f"{ratio:.0e}"


def render_check_results(results: Sequence[Any], mode: str, console: Console) -> None:
    """The table of ``hydra-kernels check`` (one line per case × shape × dtype of
    :class:`hydra_kernels.checks.CheckResult`), then the error of each check that raised.

    At 80 columns the full check's widest cells (``ccgqa_conv_zero_context``, ``2x34x5x100x100``,
    ``reference``) left the result column 3 wide, and every verdict read ``pas``/``s``. So the
    result column never wraps and holds only pass/FAIL (an error, up to 300 characters, goes
    under the table, whole and verbatim), one space parts the columns (the widest rows take 77
    columns), and should a future name be wider still, the shape and worst-item columns wrap."""
    console.print(f"checking {mode}", highlight=False)
    # the op whole: the ccgqa_conv cases differ only at the end of their names
    columns = ("dtype", "shape", "backend", "worst\nratio", "at", "result")
    table = compact_table(CHECK_TITLE, "op", columns, fold=("shape", "at"))
    table.padding = (0, 0, 0, 0)  # the box's blank separator alone between columns
    for r in results:
        verdict = Text("pass", style="green") if r.passed else Text("FAIL", style="red")
        cells = (r.op, r.dtype, r.shape, r.backend, ratio_cell(r.worst_ratio), r.worst_item or "")
        # Text cells: an op's or item's "[...]" is printed, not read as markup
        table.add_row(*(Text(c) for c in cells), verdict)
    console.print(table)
    for r in results:
        if r.error:
            console.print(Text(f"error in {r.op} {r.dtype} {r.shape}: {r.error}", style="red"))


def _ms(v: float | None) -> str:
    return f"{v:.3f}" if v else "-"


def render_bench_report(report: dict[str, Any], console: Console) -> None:
    """The compact tables ``hydra-kernels bench`` prints: one line per op × shape, then the
    sweep's best launch configuration per shape (when it ran)."""
    title = (
        f"{report['device']} (sm_{report['compute_capability'].replace('.', '')}), torch "
        f"{report['torch']}, triton {report['triton']}, liger {report['liger']}, {report['dtype']}; "
        f"copy {report['copy_tbps']:.2f} TB/s; fwd+bwd median ms"
    )
    table = Table(title=title, title_justify="left")
    cols = (
        "op",
        "shape",
        "hydra",
        "hydra GPU",
        "eager",
        "compile",
        "compile GPU",
        "liger",
        "peer/hydra",
        "rate",
        "% copy",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("op", "shape") else "right")
    table.add_column("target")
    for s in report["summary"]:
        if "tflops" in s:
            rate = f"{s['tflops']:.0f} TFLOP/s, +{s.get('peak_extra_mib', 0):.0f} MiB"
        else:
            rate = f"{s['gbps']:.0f} GB/s" if "gbps" in s else "-"
        ratio = f"{s['vs_best_peer']:.2f}x ({s['best_peer']})" if "vs_best_peer" in s else "-"
        pct = f"{s['pct_copy']:.0f}%" if "pct_copy" in s else "-"
        gpct = f"{s['graph_pct_copy']:.0f}%" if "graph_pct_copy" in s else "-"
        style = "green" if s["target"] == "met" else "red"
        table.add_row(
            s["op"], s["shape"], _ms(s.get("hydra")), _ms(s.get("hydra_graph_ms")), _ms(s.get("eager")),
            _ms(s.get("compile")), _ms(s.get("compile_graph_ms")), _ms(s.get("liger")), ratio, rate, pct,
            gpct, Text(s["target"], style=style),  # a Text: an error's "[...]" is not markup
        )  # fmt: skip
    if console.width < 200:  # a pipe or a narrow terminal would squeeze the columns into rows
        console = Console(width=200, file=console.file)
    if report["summary"]:
        console.print(table)
    for s in report["summary"]:
        for impl, m in s.get("modes", {}).items():
            time_cmp, mem_cmp = ("≤" if m["time_ok"] else ">"), ("≤" if m["memory_ok"] else ">")
            console.print(
                f"{s['op']} {s['shape']} {impl}: {m['ms']:.2f} ms, +{m['peak_extra_mib']:.0f} MiB "
                f"(time {time_cmp} compile's, memory {mem_cmp} Liger's)"
            )
    mem = [r for r in report["rows"] if "peak_extra_mib" in r and not r["impl"].startswith("hydra")]
    if mem:
        console.print(
            "peak extra memory of peers: "
            + ", ".join(f"{r['shape']} {r['impl']} +{r['peak_extra_mib']:.0f} MiB" for r in mem)
        )
    notes = {(r["impl"], r["note"]) for r in report["rows"] if r.get("note")}
    errors = [r for r in report["rows"] if r.get("error")]
    for impl, note in sorted(notes):
        console.print(f"{impl} skipped: {note}", style="dim", markup=False)
    for r in errors:
        console.print(f"{r['op']} {r['shape']} {r['impl']}: {r['error']}", style="yellow", markup=False)
    if report["sweep"]:
        sweep = Table(title="launch-config sweep (hydra fwd+bwd ms)", title_justify="left")
        for col in ("op", "shape", "default", "default ms", "best", "best ms", "gain", "best % copy"):
            sweep.add_column(col)
        for s in report["sweep"]:
            best = s["best"] or {}
            cfg = ", ".join(f"{k}={v}" for k, v in best.items() if k != "ms")
            gain = f"{100 * (1 - best['ms'] / s['default_ms']):.1f}%" if best else "-"
            default = ", ".join(f"{k}={v}" for k, v in s["default"].items())
            pct = f"{s['best_pct_copy']:.0f}%" if "best_pct_copy" in s else "-"
            sweep.add_row(
                s["op"], s["shape"], default, _ms(s["default_ms"]), cfg, _ms(best.get("ms")), gain, pct
            )
        console.print(sweep)
