"""Atomic checkpoints, finding the newest valid one, and refusing one of another model config.

Layout of a checkpoint (a ``torch.save`` dict, loadable with ``weights_only=True``)::

    format, version          "hydra-train-checkpoint", 1
    step, time, run_id       optimizer steps done, wall-clock time of the save, the run that saved it
    model_id, model_size     e.g. "tiny", "tiny"
    model                    model state dict (full, unsharded, also under FSDP)
    optimizer, scheduler     their state dicts
    rng                      python / numpy / torch CPU / CUDA generator states
    data                     {"position": micro-batches consumed (each rank), "seed": data order
                             seed, "world_size", "fingerprint" (both absent in older files)}; the
                             batch size and sequence length it counts in are the train config's;
                             the fingerprint describes the window layout (data_fingerprint.py)
    trainer                  loop state: EMAs, skipped steps (and the streak in a row: "streak",
                             absent in older files), tokens seen, validation history
    config                   {"model": <model config>.to_dict(), "train": TrainConfig.to_dict()}
                             (the architecture is ``train["arch"]``; absent in older files: HYDRA)
    callbacks                {callback name: callback.state_dict()} (SafeOptimizations lives here)
    checksum                 "sha256:..." over every tensor above (hydra_model/checkpoint_digest.py:
                             hydra-model import-hf writes checkpoints too), verified on load; files
                             without one (older) load with a note

A file with only format, version, step, model, config and checksum (``hydra-model import-hf``
writes one from a Hugging Face Llama) is a weights-only start: ``--resume`` loads its weights and
begins at step 0 with a fresh optimizer, schedule and data order (``Trainer.resume_from``).

Names: ``hydra_{model_id}_step{N}.pt`` every ``--save_every`` steps (the last ``--keep_checkpoints``
kept) and ``hydra_{model_id}_final.pt`` at the end. Resuming and pruning see only this run's
``model_id``; other models may share the folder. Both go by save time: the newest checkpoint is
the one resumed and the last ``--keep_checkpoints`` saved are the ones kept, so a fresh run in a
folder of an earlier run of the same model supersedes it (pruning by step number deleted the new
run's first checkpoints, and a ``--resume`` after its crash continued the old run). ``--resume``
where there is no checkpoint of this model is refused (a mistyped folder must not silently start
over): :func:`check_resume_dir`.

Resuming with other settings (:func:`resume_data_position`): a different ``--seed`` or
``--seq_len`` would change the data order, so it is refused; a different ``--batch_size`` or world
size continues at the same window when the windows consumed are a whole number of the new
micro-batches (else refused), ``--grad_accum`` may change freely (the position counts micro-batches).
Data that differs from the checkpoint's fingerprint (shards added, removed or replaced, another
tokenizer or ``--seq_len``) is refused naming the change, unless ``--allow_data_change`` (then a
warning: the batch order is recomputed from the new data); a checkpoint without a fingerprint
(older) resumes with a note.
The LR schedule keeps the saved step but follows this run's ``--max_steps``, ``--warmup_steps`` and
``--lr_schedule``; a change is said in one line.

Atomicity: the bytes go to a temporary file in the same folder, are flushed and fsync'ed, the file
is renamed over the final name (``os.replace`` is atomic on POSIX) and the folder is fsync'ed so
the rename survives a power cut. A crash at any point leaves either the old file set or the new
one; a leftover ``.tmp`` is ignored by :func:`find_resume_checkpoint` and removed by the next run
(run_lock.py). ``--resume`` in a folder whose checkpoints are all invalid refuses (nothing is
overwritten).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_model.checkpoint_digest import CHECKSUM_KEY, payload_digest
from hydra_model.error_text import shortened
from hydra_train.atomic_files import atomic_write, fsync_dir
from hydra_train.data_fingerprint import check_resume_data
from hydra_train.errors import HydraCheckpointError, short_error

FORMAT = "hydra-train-checkpoint"
VERSION = 1
_NAME = re.compile(r"^hydra_(?P<id>.+?)_(?:step(?P<step>\d+)|final)\.pt$")

#: HydraConfig fields that change how the model computes, not what it is: they may differ on resume.
RUNTIME_FIELDS = frozenset({"use_chunked_ce"})


def step_name(model_id: str, step: int) -> str:
    return f"hydra_{model_id}_step{step}.pt"


def final_name(model_id: str) -> str:
    return f"hydra_{model_id}_final.pt"


def save_checkpoint(payload: dict[str, Any], path: str | Path) -> Path:
    """Write ``payload`` to ``path`` atomically (see the module docstring)."""
    path = Path(path)
    payload = {**payload, CHECKSUM_KEY: payload_digest(payload)}
    atomic_write(path, lambda f: torch.save(payload, f))
    fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | Path, *, mmap: bool = False, log=None) -> dict[str, Any]:
    """Load, sanity-check and verify the checksum of a checkpoint; any failure is a
    :class:`HydraCheckpointError`. One without a checksum (older files) loads with a note to ``log``."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        # torch's reason is several sentences: whole ones kept, the parenthesis closed
        raise HydraCheckpointError(
            f"{path}: unreadable checkpoint ({type(exc).__name__}: {shortened(str(exc), 240)})"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise HydraCheckpointError(f"{path}: not a hydra-train checkpoint")
    for key in ("step", "model", "config"):
        if key not in ckpt:
            raise HydraCheckpointError(f"{path}: checkpoint has no {key!r} entry (incomplete)")
    saved = ckpt.get(CHECKSUM_KEY)
    if saved is None:
        if log is not None:
            log(f"note: {path.name} has no checksum (written by an older hydra-train); not verified")
    elif saved != payload_digest(ckpt):
        raise HydraCheckpointError(
            f"{path}: checksum mismatch (the file's bytes changed after it was written); "
            "resume from another checkpoint or delete this one"
        )
    return ckpt


def list_checkpoints(folder: str | Path, model_id: str | None = None) -> list[Path]:
    """Checkpoint files in ``folder`` (of ``model_id`` when given), by name."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.iterdir()):
        m = _NAME.match(p.name)
        if m and p.is_file() and (model_id is None or m["id"] == model_id):
            out.append(p)
    return out


def prune_checkpoints(folder: str | Path, model_id: str, keep: int) -> list[Path]:
    """Delete all but the ``keep`` most recently saved ``..._step{N}.pt`` files (0 keeps all; the
    file's time, then its step); final files stay. By save time, not step: a new run's checkpoints
    are kept over an earlier run's of higher steps."""
    if keep <= 0:
        return []
    saved = []
    for p in list_checkpoints(folder, model_id):
        m = _NAME.match(p.name)
        if m and m["step"] is not None:
            saved.append((p.stat().st_mtime_ns, int(m["step"]), p))
    saved.sort()
    removed = [p for *_, p in saved[:-keep]]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


@dataclass
class ResumePoint:
    path: Path
    step: int
    checkpoint: dict[str, Any]


def find_resume_checkpoint(
    folder: str | Path, log=print, *, model_id: str | None = None
) -> ResumePoint | None:
    """The newest valid checkpoint in ``folder`` (of ``model_id`` when given; by save time, then
    step); invalid ones are skipped with a message. Returns None when there is none."""
    candidates = []
    found = list_checkpoints(folder, model_id)
    for p in found:
        try:
            ck = load_checkpoint(p, mmap=True)
        except HydraCheckpointError as exc:
            log(f"skipping {p.name}: {exc}")
            continue
        candidates.append((float(ck.get("time", p.stat().st_mtime)), int(ck["step"]), p))
    if not candidates:
        if found:
            raise HydraCheckpointError(
                f"--resume: none of the {len(found)} checkpoint(s) in {folder} is valid (see the "
                "messages above); nothing was changed. Move them away to start from scratch"
            )
        return None
    _, step, path = max(candidates)
    return ResumePoint(path, step, load_checkpoint(path, log=log))


def check_resume_dir(folder: Path, model_id: str) -> None:
    """Refuse ``--resume`` where ``folder`` holds no checkpoint of ``model_id`` (before anything in
    ``folder`` changes, and before a missing folder is made)."""
    if not list_checkpoints(folder, model_id):
        raise no_checkpoint_error(folder, model_id)


def no_checkpoint_error(folder: Path, model_id: str) -> HydraCheckpointError:
    """The refusal of ``--resume`` where ``folder`` holds no checkpoint of ``model_id``."""
    if not folder.is_dir():
        return HydraCheckpointError(
            f"--resume: --checkpoint_dir {folder} does not exist; check the path, or drop --resume "
            "to start a new run there"
        )
    others = {m["id"]: p for p in list_checkpoints(folder) if (m := _NAME.match(p.name))}
    held = ", ".join(f"{i}{_flags_of(p)}" for i, p in sorted(others.items()))
    return HydraCheckpointError(
        f"--resume: {folder} holds no checkpoint of model {model_id} (hydra_{model_id}_step<N>.pt or "
        f"{final_name(model_id)})"
        + (f"; only of {held}: resume with those flags, or" if others else "; check --checkpoint_dir, or")
        + " drop --resume to start a new run"
    )


def _flags_of(path: Path) -> str:
    """`` (--arch A --model_size S)`` of the run that saved ``path``; empty when unreadable."""
    from hydra_model.persistence import checkpoint_arch

    try:
        ck = load_checkpoint(path, mmap=True)
        return f" (--arch {checkpoint_arch(ck['config'])} --model_size {ck['model_size']})"
    except (HydraCheckpointError, KeyError, ValueError):  # the id alone names it then
        return ""


def resume_data_position(
    ck: dict[str, Any], cfg, world_size: int, path: Path, fingerprint: dict[str, Any] | None = None
) -> tuple[int, list[str]]:
    """Where this run's data continues from checkpoint ``ck`` (micro-batch index per rank), and
    notes to print. Settings that would skip or repeat windows are refused with the saved values;
    fields an older checkpoint lacks are not checked. ``fingerprint``: this run's data
    (hydra_train.data_fingerprint; run_training always passes it), compared with the checkpoint's;
    a difference, another --seq_len among them, is refused unless --allow_data_change. None (a
    Trainer built by hand, whose data is not known here): the data is not compared."""
    data, train = ck.get("data", {}), ck["config"].get("train", {})
    saved = {k: data.get(k, train.get(k)) for k in ("seed", "seq_len", "batch_size", "grad_accum")}
    now = {
        "seed": cfg.runtime.seed,
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.data.batch_size,
        "grad_accum": cfg.optim.grad_accum,
    }
    changed = {k: v for k, v in saved.items() if v is not None and v != now[k]}
    allow = cfg.runtime.allow_data_change  # other windows: the data check below says what changed
    refused = ("seed",) if allow else ("seed", "seq_len")
    bad = [f"--{k} {now[k]} (checkpoint: {changed[k]})" for k in refused if k in changed]
    notes = []
    position = int(data["position"])
    old_ws = int(data.get("world_size", world_size))  # older files: assumed unchanged
    old_bs = int(saved["batch_size"] or cfg.data.batch_size)
    old_rows, rows = old_bs * old_ws, cfg.data.batch_size * world_size  # windows per micro-batch, all ranks
    if old_rows != rows:
        what = (
            f"--batch_size {cfg.data.batch_size} x world size {world_size} (checkpoint: {old_bs} x {old_ws})"
        )
        done = position * old_rows
        if done % rows:
            bad.append(
                f"{what}: the {done} windows read are not a whole number of {rows}-window micro-batches"
            )
        else:
            notes.append(
                f"resume: {what}: the {done} windows read so far continue at micro-batch {done // rows} "
                "of the new size (none skipped or repeated)"
            )
            position = done // rows
    if bad:
        raise HydraCheckpointError(
            f"{path} was saved by a run whose data this run would read differently (skipping or repeating "
            f"windows): {'; '.join(bad)}. Resume with the checkpoint's values, or start a new run in "
            "another --checkpoint_dir"
            + (
                " (or pass --allow_data_change to continue on the new --seq_len's windows)"
                if "seq_len" in changed
                else ""
            )
        )
    if fingerprint is not None:
        notes += check_resume_data(ck, fingerprint, allow, path)
    if "grad_accum" in changed:
        notes.append(
            f"resume: --grad_accum {now['grad_accum']} (checkpoint: {changed['grad_accum']}): the data "
            "continues where it stopped; each step now takes that many micro-batches"
        )
    return position, notes + _schedule_notes(ck.get("scheduler"), cfg)


def _schedule_notes(saved: dict[str, Any] | None, cfg) -> list[str]:
    """One line when the LR schedule's settings differ from the checkpoint's: the new ones apply."""
    if not saved:
        return []
    pairs = (
        ("max_steps", saved.get("max_steps"), cfg.runtime.max_steps),
        ("warmup_steps", saved.get("warmup"), cfg.optim.warmup_steps),
        ("lr_schedule", saved.get("kind"), cfg.optim.lr_schedule),
    )
    diffs = [f"--{k} {new} (checkpoint: {old})" for k, old, new in pairs if old is not None and old != new]
    if not diffs:
        return []
    return [
        f"resume: the learning-rate schedule follows this run's {', '.join(diffs)} from step "
        f"{saved.get('step')} on"
    ]


def resume_point(
    folder: Path, model_id: str, model_config, cfg, world_size: int, log, fingerprint: dict[str, Any]
) -> ResumePoint:
    """``--resume``'s checkpoint: the newest valid one of ``model_id`` (pruning and the database
    are per model too), checked against this run's model config, data settings and data
    (``fingerprint``) before anything in ``folder`` changes (a refusal changes nothing)."""
    found = find_resume_checkpoint(folder, log=log, model_id=model_id)
    if found is None:  # gone since check_resume_dir looked
        raise no_checkpoint_error(folder, model_id)
    check_model_config(found.checkpoint, model_config, found.path)
    if "trainer" in found.checkpoint:  # weights only: nothing of a data stream to continue
        resume_data_position(found.checkpoint, cfg, world_size, found.path, fingerprint)
    return found


def config_differences(saved_model_config: dict[str, Any], current) -> list[str]:
    """``HydraConfig.diff`` between a saved config dict and ``current``, runtime-only fields dropped."""
    try:
        saved = type(current).from_dict(saved_model_config)
    except ValueError as exc:  # a field this version does not know: an incompatible model
        return [short_error(exc, 400)]
    diffs = saved.diff(current)
    return [d for d in diffs if _diff_field(d) not in RUNTIME_FIELDS]


def _diff_field(diff: str) -> str:
    """The field a ``HydraConfig.diff`` line ("name: saved != current") is about."""
    return diff.split(":", 1)[0].strip()


def check_model_config(ckpt: dict[str, Any], current, path: Path) -> None:
    """Refuse a checkpoint of another architecture (one line naming both) or another config."""
    from hydra_model.architectures import arch_of
    from hydra_model.persistence import checkpoint_arch

    saved_arch, arch = checkpoint_arch(ckpt["config"]), arch_of(current)
    if saved_arch != arch:
        raise HydraCheckpointError(
            f"{path} holds a --arch {saved_arch} model and this run is --arch {arch}: resume with "
            f"--arch {saved_arch}, or use another --checkpoint_dir to start fresh"
        )
    diffs = config_differences(ckpt["config"]["model"], current)
    if diffs:
        hint = override_hint(ckpt["config"]["model"], diffs)
        raise HydraCheckpointError(
            f"{path} was saved for a different model config and cannot be resumed with this one; "
            f"differences (checkpoint != current): {'; '.join(diffs)}. Use the original flags{hint}, "
            "or another --checkpoint_dir to start fresh."
        )


def override_hint(saved_model_config: dict[str, Any], diffs: list[str]) -> str:
    """The ``--model_override`` flags that give back the saved values of the differing fields
    that are plain values (a preset whose layout changed since the checkpoint was written, e.g.
    the 250M/500M/1B presets of 2026-11-26: hydra_model.config.PRE_RACE_PRESETS), as
    ``" (here: --model_override dim=1280 ...)"``; empty when none is."""
    flags = []
    for name in map(_diff_field, diffs):
        value = saved_model_config.get(name)
        text = json.dumps(value) if value is None or isinstance(value, bool) else str(value)
        if isinstance(value, (bool, int, float, str, type(None))) and " " not in text:
            flags.append(f"--model_override {name}={text}")
    return f" (here: {' '.join(flags)})" if flags else ""


def capture_rng() -> dict[str, Any]:
    """Every generator the loop may draw from, in a form ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
