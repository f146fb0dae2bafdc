"""OPTIMIZATIONS.md from pretest logs: the validation-status table per GPU (rows: optimizations,
columns: model sizes; PASS / FAIL with its reason / N/A with its reason) and the measured speedup
of each optimization over the safe default at one size.

Nothing in the file is typed by hand: every cell is the latest record for that (device, size,
optimization) in ``pretest_history.json``. Regenerate with
``hydra-train pretest --report OPTIMIZATIONS.md --log_dir <folder with the logs>``.
"""

from __future__ import annotations

import statistics
from typing import Any

from hydra_train.metrics_schema import utc_time

SIZES = ("100M", "250M", "500M", "1B")
FLAGS = {
    "fa3": "--experimental_fa3",
    "cuda_graphs": "--experimental_cuda_graphs",
    "cuda_graphs[static]": "--experimental_cuda_graphs --static_routing_mode",
    "static_routing": "--static_routing_mode",
    "blackwell_tuning": "--experimental_blackwell_tuning",
    "prefetch_threads": "--experimental_prefetch_threads 4",
    "fp8": "--experimental_fp8",
    "triton_kernels": "--triton_kernels",
    "compile": "--compile",
    "8bit_adam": "--8bit_adam",
}
ROW_ORDER = (
    "fa3",
    "cuda_graphs",
    "cuda_graphs[static]",
    "static_routing",
    "blackwell_tuning",
    "prefetch_threads",
    "fp8",
    "triton_kernels",
    "compile",
    "8bit_adam",
)
LABELS = {
    "cuda_graphs": "cuda_graphs (dynamic routing)",
    "cuda_graphs[static]": "cuda_graphs (static routing)",
}


def _generation(env: dict[str, Any]) -> str:
    cap = env.get("capability")
    if not cap:
        return "CPU"
    major = int(str(cap).split(".")[0])
    return {10: "Blackwell", 12: "Blackwell", 9: "Hopper", 8: "Ampere/Ada"}.get(major, f"sm_{cap}")


def latest_results(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, tuple[dict, dict]]]]:
    """device -> size -> result key -> (result, record), the latest record winning."""
    out: dict[str, dict[str, dict[str, tuple[dict, dict]]]] = {}
    for rec in records:
        dev = (rec.get("env") or {}).get("device", "?")
        per = out.setdefault(dev, {}).setdefault(rec.get("model_size", "?"), {})
        for key, res in (rec.get("results") or {}).items():
            per[key] = (res, rec)
    return out


def _cell(res: dict[str, Any], notes: list[str]) -> str:
    st = res.get("status", "?")
    why = (res.get("reason") or "").replace("|", "/").replace("\n", " ")
    if st == "PASS":
        return "PASS"
    if not why:
        return st
    if why not in notes:
        notes.append(why)
    return f"{st} [{notes.index(why) + 1}]"


def _spread(rec: dict[str, Any]) -> str:
    ms = ((rec.get("default") or {}).get("step_ms")) or []
    if not ms:
        return "-"
    med = statistics.median(ms)
    return f"±{statistics.median(abs(t - med) for t in ms) / med:.1%}"


def _rule(rec: dict[str, Any]) -> str:
    """The speed rule the record was judged with (records before the noise-aware margin lack
    ``default_mad`` in their timing figures)."""
    timings = [(r.get("timing") or {}) for r in (rec.get("results") or {}).values()]
    judged = [t for t in timings if t.get("margin") is not None]
    if not judged:
        return "not judged"
    if any("default_mad" in t for t in judged):
        # arms judged against another reference (static routing; compile's bases) can have
        # another margin
        lo, hi = min(t["margin"] for t in judged), max(t["margin"] for t in judged)
        span = f"{lo:.0%}" if f"{lo:.0%}" == f"{hi:.0%}" else f"{lo:.0%} (up to {hi:.0%} by reference arm)"
        return f"max(5%, 3×MAD): {span}"
    return "5% (fixed; the rule before the noise-aware margin)"


def reference_of(key: str, res: dict[str, Any]) -> str:
    """The arm a result was judged against (records before 2026-11-26 do not name it)."""
    return res.get("ref") or ("static_routing" if key == "cuda_graphs[static]" else "default")


def _when(rec: dict[str, Any]) -> str:
    """A record's ``time`` as UTC, to order records by: an older version's stamp is local time
    without an offset, a newer one's UTC with it (pretest_log.timestamp); their text order is not
    their time order."""
    return str(utc_time(str(rec.get("time") or "")))


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def build_report(records: list[dict[str, Any]], *, speedup_size: str = "100M", command: str = "") -> str:
    if not records:
        raise ValueError("no pretest records: run hydra-train pretest first")
    lines = [
        "# HYDRA optimizations: measured validation status",
        "",
        "Generated from the pretest logs by",
        "",
        f"    {command or 'hydra-train pretest --report OPTIMIZATIONS.md --log_dir <logs>'}",
        "",
        "Do not edit by hand; rerun the command. Each cell is the latest pretest of that optimization at",
        "that size on that GPU (PASS: it ran, stayed finite, matched the safe default within the stated",
        "tolerance and was not slower; FAIL [n]: see reason n; N/A [n]: not applicable, or its arm ran",
        "the reference's own code so that there was no speed to judge, reason n). The",
        "tolerances are in `src/hydra_train/safe_opts/tolerances.py`; README.md, section SafeOptimizations,",
        "explains the pretest.",
        "",
    ]
    for dev, per_size in latest_results(records).items():
        envs = [rec.get("env") or {} for per in per_size.values() for _, rec in per.values()]
        env = envs[-1] if envs else {}
        present = [s for s in SIZES if s in per_size] + [s for s in per_size if s not in SIZES]
        # the seed's four columns always, so that a size not pretested yet shows as such
        sizes = list(SIZES) + [s for s in present if s not in SIZES] if _generation(env) != "CPU" else present
        notes: list[str] = []
        lines += [
            f"## {dev} ({_generation(env)}, sm_{str(env.get('capability')).replace('.', '')})",
            "",
            f"torch {env.get('torch')}, triton {env.get('triton')}, Python {env.get('python')}.",
            "",
            "### Pretest settings",
            "",
            "| size | parameters | batch × seq | precision | steps: untimed + timed | default step spread "
            "| slower if beyond | data | when |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for size in present:
            rec = max((r for _, r in per_size[size].values()), key=_when)
            st = rec.get("settings") or {}
            cfg = rec.get("config") or {}
            b = rec.get("batch") or [cfg.get("batch_size"), cfg.get("seq_len")]
            params = cfg.get("params")
            lines.append(
                f"| {size} | {_fmt(params / 1e6 if params else None, '.1f')}M | {b[0]} × {b[1]} "
                f"(accum {rec.get('grad_accum', 1)}) | {rec.get('precision')} | {st.get('warmup_steps')} + "
                f"{st.get('steps')} | {_spread(rec)} | {_rule(rec)} | {cfg.get('dataset', '-')} | "
                f"{rec.get('time')} |"
            )
        lines += [
            "",
            "Default step spread: median absolute deviation of the safe default's timed steps over their",
            'median. A speed verdict (reason "slower") is meaningful only well beyond it; each reason',
            "states the margin it was judged with.",
        ]
        lines += ["", "### Validation status", "", "| optimization | flag | " + " | ".join(sizes) + " |"]
        lines.append("|---|---|" + "---|" * len(sizes))
        keys = [k for k in ROW_ORDER if any(k in per_size[s] for s in present)]
        for key in keys:
            cells = [
                _cell(per_size[s][key][0], notes) if key in per_size.get(s, {}) else "not run" for s in sizes
            ]
            lines.append(f"| {LABELS.get(key, key)} | `{FLAGS.get(key, '')}` | " + " | ".join(cells) + " |")
        if speedup_size in per_size:
            lines += _speedup(per_size[speedup_size], speedup_size)
        if notes:
            lines += ["", "Reasons:", ""] + [f"{i + 1}. {n}" for i, n in enumerate(notes)]
        lines.append("")
    return "\n".join(lines)


def _speedup(per: dict[str, tuple[dict, dict]], size: str) -> list[str]:
    out = [
        "",
        f"### Speedup over the reference arm ({size})",
        "",
        "Median time per optimizer step over the timed steps (batch fetch included; each step bracketed by",
        "device synchronisation), the optimization against its reference arm, same weights and batches.",
        "",
        "The reference is the safe default, except for cuda_graphs (static routing), whose reference is the",
        "eager static-routing arm (the graph is what is measured, not the routing mode), and for compile,",
        "pretested on top of the triton_kernels and fa3 that passed, whose reference is their arm.",
        "",
        "| optimization | status | reference | reference ms/step | with it ms/step | speedup | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ROW_ORDER:
        if key not in per:
            continue
        res, rec = per[key]
        t = res.get("timing") or {}
        b = rec.get("batch") or [0, 0]
        tok = b[0] * b[1] * rec.get("grad_accum", 1)
        ms, dms = t.get("median_ms"), t.get("default_median_ms")
        tps = tok / (ms / 1000) if ms else None
        note = "" if t.get("judged", True) else " (not judged)"
        out.append(
            f"| {LABELS.get(key, key)} | {res.get('status')} | {reference_of(key, res)} | "
            f"{_fmt(dms, '.2f')} | {_fmt(ms, '.2f')} | "
            f"{_fmt(t.get('speedup'), '.3f')}{note} | {_fmt(tps, ',.0f')} |"
        )
    return out
