"""The pretest's step-0 probe: an arm's loss and gradients at the snapshot's weights against an fp32
reference with the safe defaults (:class:`hydra_train.safe_opts.pretest.PretestRunner` calls it).

Under FSDP2 each rank holds a shard of every gradient (a DTensor, which does not mix with plain
tensors): the probe compares this rank's shards and sums the squares over the ranks, so that the
norms and errors are those of the whole gradients; under DDP or one process every rank holds them
whole.

Both run training-mode forwards, which add to the model's buffers (the causal routing thresholds'
records, an MoE layer's pending load): :func:`buffers_kept` puts every buffer back afterwards, so
that what a probe saw never reaches a training step's threshold commit or bias update."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from hydra_train.distributed import all_reduce_sum, is_fsdp
from hydra_train.trainer import Trainer


def own_shard(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: its local shard under FSDP2, the gradient itself otherwise."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def buffer_values(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every buffer of ``model`` with a copy of its value, for :func:`put_back`."""
    return [(b, b.detach().clone()) for b in model.buffers()]


@torch.no_grad()
def put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy the values back in place (a captured CUDA graph or compiled step keeps reading the
    same tensors); a cache rebuilt at another size since is left as it is."""
    for b, value in saved:
        if b.shape == value.shape:
            b.copy_(value)


@contextlib.contextmanager
def buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Run the block, then put every buffer of ``model`` back to its value before it."""
    saved = buffer_values(model)
    try:
        yield
    finally:
        put_back(saved)


def _grads(tr: Trainer) -> list[torch.Tensor | None]:
    return [p.grad for p in tr.params]


def _whole_sum(tr: Trainer, local_sum: torch.Tensor) -> float:
    """A sum over this rank's gradient shards, summed over the ranks under FSDP2 (every rank calls
    this: it is collective there)."""
    if is_fsdp(tr.wrapped):
        all_reduce_sum(tr.dist, local_sum)
    return float(local_sum)


def reference_at(
    tr: Trainer, batch: tuple[torch.Tensor, torch.Tensor], chunk_rows: int, device: torch.device
) -> dict[str, Any]:
    """fp32, safe defaults, no autocast: the loss and gradients (this rank's shards) of ``tr``'s
    model as it is, on ``batch`` in chunks of ``chunk_rows`` rows; ``norm`` is the whole gradient's."""
    x, y = (t.to(device) for t in batch)
    rows = max(1, chunk_rows)
    chunks = list(zip(x.split(rows), y.split(rows), strict=True))
    loss = torch.zeros((), dtype=torch.float64, device=device)
    with buffers_kept(tr.model):
        for xc, yc in chunks:
            out = tr.wrapped(xc, yc)
            (out.loss / len(chunks)).backward()
            loss += out.loss.detach().double() / len(chunks)
    grads = [None if g is None else own_shard(g.detach()).float().clone() for g in _grads(tr)]
    tr.model.zero_grad(set_to_none=True)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g is not None:
            sq += (g.double() ** 2).sum()
    return {"loss": float(loss), "grads": grads, "norm": math.sqrt(_whole_sum(tr, sq))}


def probe_against(
    pt: Trainer,
    tr: Trainer,
    batch: tuple[torch.Tensor, torch.Tensor],
    ref: dict[str, Any] | None,
    device: torch.device,
) -> tuple[float, tuple[float, float] | None]:
    """The arm's loss on ``batch`` through ``pt`` (the pretest trainer, its optimizations active)
    and, against ``ref`` (:func:`reference_at`), (gradient error, loss error), relative."""
    x, y = (t.to(device) for t in batch)
    with buffers_kept(tr.model):
        with pt.autocast():
            out = pt.forward_model(x, y, **pt.forward_kwargs)
        out.loss.backward()
    loss = float(out.loss.detach().double())
    err = None
    if ref is not None:
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g, r in zip(_grads(tr), ref["grads"], strict=True):
            if g is None and r is None:
                continue
            gg = torch.zeros_like(r) if g is None else own_shard(g.detach()).float()
            rr = torch.zeros_like(gg) if r is None else r
            sq += ((gg - rr).double() ** 2).sum()
        diff = math.sqrt(_whole_sum(tr, sq))
        err = (diff / max(ref["norm"], 1e-30), abs(loss - ref["loss"]) / abs(ref["loss"]))
    tr.model.zero_grad(set_to_none=True)
    return loss, err
