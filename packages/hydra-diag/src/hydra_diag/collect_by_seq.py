"""``convert collect-by-seq``: reorganise ``.pt`` shards by sequence length.

hydra-train wants one row length per dataset (row shards fix the sequence length), so a folder
mixing rows of several lengths cannot be trained on as it is. This reads every ``.pt`` shard of
the inputs (``weights_only``), groups row shards (``{"input_ids": [N, L]}``) by their sequence
length ``L − 1``, and writes each group to ``OUT/seq_<L−1>/`` as shards of at most
``rows_per_shard`` rows, in input order. Stream shards (a 1-D tensor or ``{"tokens": 1-D}``) have
no length of their own: they are copied to ``OUT/stream/``. A ``tokenizer.json``/``meta.json``
beside the inputs is copied into every group folder, and ``OUT/manifest.json`` lists the groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from hydra_diag.convert import _save_shard, input_files
from hydra_diag.output import DiagError, Progress, no_progress


def classify_shard(path: Path) -> tuple[str, torch.Tensor]:
    """("rows", [N, L]) or ("stream", 1-D) for a hydra-train ``.pt`` shard; anything else is a DiagError."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DiagError(f"{path}: unreadable .pt shard ({type(exc).__name__}: {str(exc)[:120]})") from None
    if isinstance(obj, dict):
        if isinstance(obj.get("input_ids"), torch.Tensor) and obj["input_ids"].ndim == 2:
            return "rows", obj["input_ids"]
        if isinstance(obj.get("tokens"), torch.Tensor) and obj["tokens"].ndim == 1:
            return "stream", obj["tokens"]
    elif isinstance(obj, torch.Tensor) and obj.ndim == 1:
        return "stream", obj
    raise DiagError(
        f'{path}: not a token shard (expected {{"input_ids": 2-D}}, {{"tokens": 1-D}} or a 1-D tensor)'
    )


def collect_by_seq(
    inputs: list[str], out_dir: str, rows_per_shard: int = 8192, progress: Progress = no_progress
) -> dict[str, Any]:
    """Group the inputs' shards by sequence length (see the module docstring)."""
    if rows_per_shard < 1:
        raise DiagError("--rows-per-shard must be at least 1")
    files = input_files(inputs, ".pt")
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        raise DiagError(f"output folder {out} is not empty; choose a new one")
    groups: dict[str, dict[str, Any]] = {}
    pending: dict[str, list[torch.Tensor]] = {}

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(
            name, {"folder": str(out / name), "rows": 0, "tokens": 0, "sources": [], "shards": []}
        )

    def flush(name: str, final: bool = False) -> None:
        g, buf = group(name), pending.get(name, [])
        while buf:
            rows = torch.cat(buf)
            if rows.shape[0] < rows_per_shard and not final:
                pending[name] = [rows]
                return
            head, rest = rows[:rows_per_shard], rows[rows_per_shard:]
            path = out / name / f"part{len(g['shards']):05d}.pt"
            _save_shard(path, {"input_ids": head.contiguous()})
            g["shards"].append(str(path))
            buf = [rest] if rest.shape[0] else []
        pending[name] = []

    for i, f in enumerate(files):
        progress(f"{i + 1}/{len(files)}: {f.name}")
        kind, t = classify_shard(f)
        if kind == "rows":
            name = f"seq_{t.shape[1] - 1}"
            g = group(name)
            g["rows"] += int(t.shape[0])
            g["tokens"] += int(t.numel())
            g["sources"].append(str(f))
            pending.setdefault(name, []).append(t)
            flush(name)
        else:
            g = group("stream")
            g["tokens"] += int(t.numel())
            g["sources"].append(str(f))
            dest = out / "stream" / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():  # two inputs with one name: keep both
                dest = dest.with_name(f"{dest.stem}_{i}{dest.suffix}")
            shutil.copyfile(f, dest)
            g["shards"].append(str(dest))
    for name in list(pending):
        flush(name, final=True)
    extras = {
        p.name: p for f in files for p in (f.parent / "tokenizer.json", f.parent / "meta.json") if p.is_file()
    }
    for g in groups.values():
        for name, src in extras.items():
            shutil.copyfile(src, Path(g["folder"]) / name)
    manifest = {"format": "hydra-diag-collect/1", "inputs": [str(f) for f in files], "groups": groups}
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return {"tool": "collect_pt_by_seq", "out_dir": str(out), **manifest}


def render_collect(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    rows = [
        {
            "group": k,
            "rows": g["rows"],
            "tokens": g["tokens"],
            "input_files": len(g["sources"]),
            "shards": len(g["shards"]),
            "folder": g["folder"],
        }
        for k, g in sorted(result["groups"].items())
    ]
    console.print(
        rows_table(f"collect-by-seq: {len(result['inputs'])} input shard(s) → {result['out_dir']}", rows)
    )
