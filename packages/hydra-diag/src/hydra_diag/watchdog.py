"""``moe watchdog``: follow a training run's folder and flag MoE experts that collapse or die.

Each poll reads the run's ``routing_moe`` rows from the metrics database (utilisation per layer at
every logged step) and, when a new checkpoint has appeared, its expert weight norms
(:func:`hydra_diag.moe_analysis.weight_balance`). Alerts, per layer:

* ``dead_expert`` (error): an expert below ``dead_share`` of its fair share 1/E in every one of
  the last ``window`` logged steps;
* ``collapsed`` (error): one expert taking ``collapse_share`` of the tokens at the latest step;
* ``collapsing`` (warning): the largest share ≥ ``warn_ratio`` × fair share and risen by at least
  ``trend_delta`` over the window;
* ``entropy_low`` (warning): router entropy below ``entropy_frac`` · ln E.

``--once`` polls a single time (scripts, tests); otherwise it polls every ``interval`` seconds
until the run is no longer ``running``, ``max_polls`` is reached, or Ctrl-C.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra_diag.output import DiagError, Progress, no_progress
from hydra_diag.run_db import load_run


@dataclass(frozen=True)
class WatchThresholds:
    window: int = 3
    dead_share: float = 0.1
    collapse_share: float = 0.9
    warn_ratio: float = 2.0
    trend_delta: float = 0.05
    entropy_frac: float = 0.1


def assess_moe_rows(
    rows: list[dict[str, Any]], top_k: int, th: WatchThresholds
) -> tuple[list[dict], list[dict]]:
    """(per-layer status, alerts) from routing_moe rows (``utilization`` already a list)."""
    by_layer: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_layer.setdefault(int(r["layer"]), []).append(r)
    status, alerts = [], []

    def alert(sev, kind, layer, step, msg):
        alerts.append({"severity": sev, "kind": kind, "layer": layer, "step": step, "message": msg})

    for layer, lr in sorted(by_layer.items()):
        lr.sort(key=lambda r: r["step"])
        recent = [r for r in lr if r.get("utilization")][-th.window :]
        if not recent:
            continue
        last = recent[-1]
        util = last["utilization"]
        n = len(util)
        fair = 1.0 / n
        top = max(util)
        first_top = max(recent[0]["utilization"])
        dead = [e for e in range(n) if all(r["utilization"][e] < th.dead_share * fair for r in recent)]
        status.append(
            {
                "layer": layer,
                "step": last["step"],
                "utilization": util,
                "max_share": top,
                "max_share_change": top - first_top,
                "entropy": last.get("entropy"),
                "max_violation": last.get("max_violation"),
                "dead_experts": dead,
            }
        )
        if dead and len(recent) >= min(th.window, len(lr)):
            alert(
                "error",
                "dead_expert",
                layer,
                last["step"],
                f"experts {dead} below {th.dead_share:.0%} of their fair share for the last "
                f"{len(recent)} logs",
            )
        if top * top_k >= th.collapse_share and n > top_k:
            alert(
                "error",
                "collapsed",
                layer,
                last["step"],
                f"expert {util.index(top)} takes {top * top_k:.0%} of the tokens",
            )
        elif top >= th.warn_ratio * fair and top - first_top >= th.trend_delta:
            alert(
                "warning",
                "collapsing",
                layer,
                last["step"],
                f"expert {util.index(top)}'s share rose {first_top:.2f} -> {top:.2f} (fair share {fair:.2f})",
            )
        ent = last.get("entropy")
        if ent is not None and n > 1 and ent < th.entropy_frac * math.log(n):
            alert(
                "warning",
                "entropy_low",
                layer,
                last["step"],
                f"router entropy {ent:.3f} < {th.entropy_frac:.0%} of ln {n}",
            )
    return status, alerts


def _newest_checkpoint(folder: Path) -> Path | None:
    from hydra_train.checkpoint import list_checkpoints

    found = list_checkpoints(folder)
    return max(found, key=lambda p: (p.stat().st_mtime, p.name)) if found else None


def poll_once(
    folder: Path, run_id: str | None, th: WatchThresholds, seen_ckpt: dict[str, Any]
) -> dict[str, Any]:
    """One look at the run: DB status and alerts, and the newest checkpoint's balance when new."""
    from hydra_diag.moe_analysis import weight_balance

    data = load_run(folder, run_id)
    cfg = data.model_config()
    top_k = cfg.moe_top_k if cfg is not None else 1
    status, alerts = assess_moe_rows(data.routing_moe, top_k, th)
    out: dict[str, Any] = {
        "run_id": data.run_id,
        "run_status": data.run.get("status"),
        "last_step": data.steps[-1]["step"] if data.steps else None,
        "moe_enabled": bool(cfg and cfg.moe_enabled),
        "layers": status,
        "alerts": alerts,
        "checkpoint": seen_ckpt.get("summary"),
        "history": [
            {"step": r["step"], "layer": r["layer"], "utilization": r["utilization"]}
            for r in data.routing_moe
        ],
    }
    ckpt = _newest_checkpoint(folder)
    if ckpt is not None and (
        seen_ckpt.get("path") != str(ckpt) or seen_ckpt.get("mtime") != ckpt.stat().st_mtime
    ):
        try:
            wb = weight_balance(str(ckpt))
            summary = {
                "path": str(ckpt),
                "step": wb["step"],
                "gate_up_imbalance": {lay["layer"]: lay["gate_up_imbalance"] for lay in wb["layers"]},
                "router_imbalance": {lay["layer"]: lay["router_imbalance"] for lay in wb["layers"]},
            }
            for f in wb["findings"]:
                alerts.append({**f, "step": wb["step"]})
        except DiagError as exc:  # a checkpoint being written, or a model without experts
            summary = {"path": str(ckpt), "error": str(exc)}
        seen_ckpt.update(path=str(ckpt), mtime=ckpt.stat().st_mtime, summary=summary)
        out["checkpoint"] = summary
    if not out["moe_enabled"]:
        alerts.append(
            {
                "severity": "info",
                "kind": "no_moe",
                "layer": None,
                "step": None,
                "message": "this run's model has no MoE layers: nothing to watch",
            }
        )
    return out


def watch_run(
    folder: str,
    run_id: str | None = None,
    once: bool = False,
    interval: float = 30.0,
    max_polls: int | None = None,
    thresholds: WatchThresholds = WatchThresholds(),
    on_poll: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Poll until done (see the module docstring); ``on_poll(report, new_alerts)`` after each poll."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise DiagError(f"run folder {root} does not exist (pass the run's --checkpoint_dir)")
    seen: set[tuple] = set()
    all_alerts: list[dict[str, Any]] = []
    ckpt_state: dict[str, Any] = {}
    polls, report = 0, {}
    try:
        while True:
            polls += 1
            progress(f"poll {polls}")
            report = poll_once(root, run_id, thresholds, ckpt_state)
            new = []
            for a in report["alerts"]:
                key = (a["kind"], a.get("layer"), a.get("message"))
                if key not in seen:
                    seen.add(key)
                    new.append(a)
            all_alerts += new
            if on_poll is not None:
                on_poll(report, new)
            if once or report["run_status"] != "running" or (max_polls is not None and polls >= max_polls):
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return {
        "tool": "moe_watchdog",
        "folder": str(root),
        "polls": polls,
        **report,
        "all_alerts": all_alerts,
        "thresholds": asdict(thresholds),
    }


def render_watchdog(result: dict[str, Any], console) -> None:
    from hydra_diag.render import print_findings, rows_table

    console.print(
        f"[bold]moe watchdog[/] {result['folder']}: run {result.get('run_id')} "
        f"({result.get('run_status')}, last step {result.get('last_step')}), {result['polls']} poll(s)",
        highlight=False,
    )
    if result.get("layers"):
        console.print(
            rows_table(
                "experts at the latest logged step",
                result["layers"],
                ["layer", "step", "utilization", "max_share", "max_share_change", "entropy", "dead_experts"],
                formats={"utilization": ".3f"},
            )
        )
    if result.get("checkpoint"):
        console.print(f"newest checkpoint: {result['checkpoint']}", highlight=False)
    print_findings(console, result["all_alerts"], "alerts")
