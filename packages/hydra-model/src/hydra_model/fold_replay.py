"""A new cache's CCGQA conv-weight fold replayed from a CUDA graph instead of launched op by op.

Why: every generate call that builds its decoder (a new batch size or cache bucket, or the first
call after ``release_decoder``) gets a new cache, and a new cache's bank folds the conv weights of
all twelve blocks again (ccgqa_fold.py: about 23 launches and the Python around them). The GPU
work is tiny; on an H100 host it was about 2.5 ms of the eager prefill's host time, the largest
single piece of the gap between HYDRA's and the GPT's prefill (packages/hydra-model/BENCHMARKS.md,
"Where HYDRA's eager prefill spends its host time").

How: the fold reads nothing but the modules' parameters and constants of their shapes, so a graph
of it replayed later computes the fold of whatever those parameters hold then. Updates in place
(an optimizer step, eager or itself replayed from a graph, a ``copy_`` of loaded weights) are
therefore seen without any check. What a graph cannot see is a parameter replaced by another
tensor (``model.to(...)``, ``load_state_dict(assign=True)``): each replay first compares the
modules' conv sources (address, shape, dtype, device: :func:`~hydra_model.ccgqa_fold.conv_sources`,
host-side) with those captured, and folds eagerly, forgetting the graph, when they differ.

Policy: a group's first fold of a form in the process runs eagerly (a one-off generation pays no
capture); the second captures, then replays; later ones replay. The replayed outputs are the
graph's own buffers, so the bank gets copies (one launch per output buffer): a bank kept by an
older cache keeps the weights it was built with. Only on CUDA, without gradients, outside another
capture and outside ``torch.compile``; elsewhere :func:`fold_group` is ``fold_many``. A capture that
fails is counted (:func:`replay_status`), warned about once, and that group folds eagerly from then
on.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from hydra_kernels.cuda_graph import graph_capture
from hydra_kernels.ops.tile_linear import TiledWeight
from hydra_model import ccgqa_fold  # by module: tests spy on ccgqa_fold.fold_many

#: the fold's graphs of each group, by its first module (gone with the model)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATUS = {"eager": 0, "captured": 0, "replayed": 0, "capture_failed": 0, "last_error": None}


@dataclass
class _Entry:
    """One group and form: what it was folded from, and its graph once captured."""

    members: tuple[int, ...]  # the group's modules, by id, in order
    sources: tuple  # conv_sources of each member when captured (or first folded)
    graph: Any = None
    outputs: list = field(default_factory=list)
    failed: bool = False


def replay_status() -> dict:
    """Folds run eagerly, graphs captured, replays, failed captures (and the last error) since
    import or :func:`reset_replay_status`."""
    return dict(_STATUS)


def reset_replay_status() -> None:
    _STATUS.update(eager=0, captured=0, replayed=0, capture_failed=0, last_error=None)


def replayable(group: list) -> bool:
    """Whether ``group``'s fold may come from a graph: CUDA parameters that are plain tensors (not
    FSDP2's shards), no gradients wanted, no capture open on this thread, not compiling."""
    first = group[0].conv_seq.weight
    if not first.is_cuda or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if torch.cuda.is_current_stream_capturing():  # another capture (a graphed prefill) records it
        return False
    return all(type(m.conv_seq.weight) in (torch.Tensor, torch.nn.Parameter) for m in group)


def fold_group(group: list, form: str, sources: list | None = None) -> list:
    """``ccgqa_fold.fold_many(group, form)``, from a graph replay where :func:`replayable` (the
    module docstring says when). ``sources``: the members' ``conv_sources``, if the caller has
    them already."""
    if not replayable(group):
        return ccgqa_fold.fold_many(group, form)
    members = tuple(id(m) for m in group)
    sources = tuple(sources) if sources is not None else tuple(ccgqa_fold.conv_sources(m) for m in group)
    forms = _GROUPS.setdefault(group[0], {})
    entry = forms.get(form)
    if entry is None or entry.members != members or entry.sources != sources:
        forms[form] = _Entry(members, sources)  # first fold of these tensors: eager
        _STATUS["eager"] += 1
        return ccgqa_fold.fold_many(group, form)
    if entry.failed:
        _STATUS["eager"] += 1
        return ccgqa_fold.fold_many(group, form)
    if entry.graph is None and not _capture(entry, group, form):
        return ccgqa_fold.fold_many(group, form)
    entry.graph.replay()
    _STATUS["replayed"] += 1
    return _copied(entry.outputs)


def _record(run, device: torch.device) -> tuple[Any, list]:
    """(graph, its output buffers): ``run`` captured on ``device``, not run (replay to run it)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: a data loader's thread may be copying to the GPU meanwhile
    with torch.cuda.device(device), graph_capture(graph, capture_error_mode="thread_local"):
        outputs = run()
    return graph, outputs


def _capture(entry: _Entry, group: list, form: str) -> bool:
    try:
        entry.graph, entry.outputs = _record(
            lambda: ccgqa_fold.fold_many(group, form), group[0].conv_seq.weight.device
        )
    except Exception as exc:  # counted and warned; this group folds eagerly from now on
        entry.failed = True
        _STATUS["capture_failed"] += 1
        _STATUS["eager"] += 1
        _STATUS["last_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if _STATUS["capture_failed"] == 1:
            warnings.warn(
                f"hydra_model: capturing CCGQA's conv-weight fold failed ({_STATUS['last_error']}); "
                "it runs op by op instead (hydra_model.fold_replay.replay_status() counts this)",
                RuntimeWarning,
                stacklevel=4,
            )
        return False
    _STATUS["captured"] += 1
    return True


def _copied(outputs: list) -> list:
    """The fold's outputs with every tensor in memory of its own: each buffer the outputs view
    copied once (a form's L weights are views of one stacked tensor), the views made again on
    the copy."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        base = t if t._base is None else t._base
        if base.storage_offset() != 0 or not base.is_contiguous():
            return t.clone()
        held = copies.get(id(base))
        if held is None:
            held = copies[id(base)] = base.clone()
        return held.as_strided(t.size(), t.stride(), t.storage_offset())

    def copy_weight(w: torch.Tensor | TiledWeight) -> torch.Tensor | TiledWeight:
        if isinstance(w, TiledWeight):
            return TiledWeight(copy(w.tiles), copy(w.index), w.out_features, w.in_features)
        return copy(w)

    return [(copy_weight(w), copy(b)) for w, b in outputs]
