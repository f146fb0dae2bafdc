"""One optimizer step: the body that eager and CUDA-graphed execution share.

:meth:`StepMixin.micro_step` is the step: forward and backward of every micro-batch, the gradient
norm (clipping with ``--grad_clip``), the finiteness check and :meth:`StepMixin.apply_if_finite`
(the optimizer and the commit of the causal routing thresholds). :meth:`StepMixin.eager_step`
runs it and clears the gradients; a CUDA graph (:mod:`hydra_train.graphed_step`) captures the same
body and replays it. :meth:`StepMixin.run_step`, the trainer's default ``step_impl``, picks the
graph when one is enabled (``enable_cuda_graphs``) and the eager step otherwise.

Gradient averaging over ranks: DDP's reducer on the last micro-batch (``no_sync()`` before), or,
with ``grad_averager`` set (a graphed DDP step, or ``--ddp_grad_sync allreduce``), DDP silent and
:class:`hydra_train.data_parallel.GradAverager` after the last backward, in the step body itself,
so that a graph captures it. Buffers: rank 0's on every rank before a step's first forward (DDP's
forward, the averager, or the step itself under FSDP2, which never syncs them); loss-free MoE
balancing's pending load is summed over ranks after every micro-batch, so that its bias follows the
whole global batch as one process's does (:meth:`StepMixin._sum_balance_loads`).

Clipping (``--grad_clip``): a fused torch Adam/AdamW clips as it reads the gradients (its
``grad_scale``, :func:`hydra_train.optim.clip_divisor`), so only the norm is computed here; other
optimizers get ``clip_grad_norm_``, a pass of its own over the gradients.

The non-finite rule: ``finite = isfinite(total grad norm) & isfinite(loss)``, one fused reduction
(the grad-norm computation already visits every gradient); under DDP/FSDP only the norm of the
synchronised gradients decides, so that every rank takes the same decision. A fused torch
Adam/AdamW receives ``found_inf = ~finite`` and skips the update *on the device* (weights, moments
and step count untouched), so the step needs no host sync; other optimizers are stepped only after
reading the flag (one sync).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hydra_train.data_parallel import broadcast_buffers
from hydra_train.distributed import all_reduce_sum, coalesced, grad_sync, is_fsdp
from hydra_train.optim import clip_divisor, folds_grad_clip, grad_norm_for_step, step_with

if TYPE_CHECKING:
    from hydra_train.data_parallel import GradAverager
    from hydra_train.graphed_step import GraphedStep


@dataclass
class StepResult:
    """What a step returns; tensors on the training device."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    aux_losses: dict[str, torch.Tensor]
    grad_norm: torch.Tensor
    finite: torch.Tensor

    def clone(self) -> StepResult:
        """A copy that outlives the buffers it came from (a graph replay overwrites its outputs)."""
        return StepResult(
            self.loss.clone(),
            self.ce_loss.clone(),
            {k: v.clone() for k, v in self.aux_losses.items()},
            self.grad_norm.clone(),
            self.finite.clone(),
        )


class LossSums:
    """Running sums of the detached fp32 losses (total, CE, each auxiliary term) of one step's
    micro-batches."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.ce: torch.Tensor | None = None
        self.aux: dict[str, torch.Tensor] = {}

    def add(self, out: Any, loss_scale: torch.Tensor | None = None) -> None:
        """Add one forward's losses; ``loss_scale`` multiplies the total as it multiplied the
        backpropagated loss."""
        loss = out.loss.detach().float()
        if loss_scale is not None:
            loss = loss * loss_scale
        ce = out.ce_loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss
        self.ce = ce if self.ce is None else self.ce + ce
        for k, v in out.aux_losses.items():
            v = v.detach().float()
            self.aux[k] = v if k not in self.aux else self.aux[k] + v

    def means(self, n: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, CE, auxiliary terms) averaged over ``n`` micro-batches."""
        return self.loss / n, self.ce / n, {k: v / n for k, v in self.aux.items()}


def loss_only_kwargs(model: torch.nn.Module) -> dict[str, bool]:
    """What the training forward passes to ask ``model`` for its losses alone:
    ``{"return_logits": False}`` where its ``forward`` takes that keyword (HYDRA's and the dense
    GPT's), else nothing. The step reads only the losses, and a compiled forward would give logits
    it returns a zero gradient of their size in its backward (a fill and an add of [B, S, V]:
    hydra_model.decoder.check_return_logits); with chunked CE there are no logits anyway."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return {}
    return {"return_logits": False} if "return_logits" in params else {}


def supports_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Fused torch Adam/AdamW skip their update on device when ``found_inf`` is set (the same
    optimizers that clip as they step: :func:`hydra_train.optim.folds_grad_clip`)."""
    return folds_grad_clip(opt)


class StepMixin:
    """The step half of :class:`hydra_train.trainer.Trainer` (which sets every attribute used here)."""

    cuda_graphs: GraphedStep | None
    #: keywords of every training forward (:func:`loss_only_kwargs`)
    forward_kwargs: dict[str, bool]
    #: set: the gradients are averaged over ranks by hand after backward, DDP's reducer silent
    grad_averager: GradAverager | None

    def autocast(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    def micro_step(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        loss_scale: torch.Tensor | None = None,
        hooks: bool = True,
    ) -> StepResult:
        """The step body (see the module docstring). ``loss_scale`` multiplies every loss before
        backward (a graph's input; 1.0 except under fault injection); ``hooks=False`` skips the
        ``on_after_backward`` callbacks, which a captured graph could not replay."""
        n = len(batches)
        sums = LossSums()
        averager = self.grad_averager
        if averager is not None:
            averager.broadcast_buffers()  # what DDP's forward does once per step
        elif self.dist.enabled and is_fsdp(self.wrapped):
            # FSDP2 replicates buffers but never syncs them: a buffer a training forward moves from
            # this rank's own data would drift apart on every rank and the ranks would compute
            # differently. Rank 0's, as DDP does once per step (MoE's loss-free balancing load is
            # summed over ranks instead: _sum_balance_loads)
            broadcast_buffers(self.model)
        for i, (x, y) in enumerate(batches):
            # with the hand-rolled averaging DDP's reducer stays silent on every micro-batch
            with grad_sync(self.wrapped, enabled=averager is None and i == n - 1):
                with self.autocast():
                    out = self.forward_model(x, y, **self.forward_kwargs)
                loss = out.loss if loss_scale is None else out.loss * loss_scale
                (loss / n).backward()
            sums.add(out, loss_scale)
            self._sum_balance_loads()
        if averager is not None:
            averager.average_gradients()  # before anything reads them: hooks, norm, optimizer
        if hooks:
            self.callbacks.call("on_after_backward", self.step + 1, self.model)
        grad_norm, clip = self._grad_norm()
        loss_mean, ce_mean, aux_mean = sums.means(n)
        finite = torch.isfinite(grad_norm)
        if not self.dist.enabled:  # ranks decide from the synchronised gradients only, so they agree
            finite = finite & torch.isfinite(loss_mean)
        self.apply_if_finite(finite, clip)
        return StepResult(loss_mean, ce_mean, aux_mean, grad_norm, finite)

    def eager_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """The step body run eagerly, gradients cleared after it."""
        res = self.micro_step(batches)
        self.optimizer.zero_grad(set_to_none=True)
        return res

    def run_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """One optimizer step: the CUDA graph when enabled, else the eager step. A graph that
        cannot be captured or replayed is dropped, reported to the callbacks
        (``on_graph_failure``) and the step runs eagerly; under DDP a failed replay stops the run
        with that advice instead (a capture failure the ranks agree on still falls back)."""
        graphs = self.cuda_graphs
        if graphs is None or graphs.take_eager_step():
            if graphs is not None:  # a loss scale meant for a graphed step must not wait for one
                graphs.scale_next_loss(None)
            return self.eager_step(batches)
        try:
            res = graphs(batches)
        except Exception as exc:
            if graphs.step_applied:  # the optimizer step ran (copying its outputs failed): no rerun
                raise
            if self.dist.enabled:
                # the other ranks are inside this step's collectives: stepping eagerly here alone
                # would leave them waiting or pair mismatched collectives. Stop, and say so.
                raise RuntimeError(
                    f"the CUDA-graphed step failed on rank {self.dist.rank} ({type(exc).__name__}: "
                    f"{str(exc)[:300]}); under DDP one rank cannot fall back to eager steps alone. "
                    "Rerun with --no-experimental_cuda_graphs to train eagerly"
                ) from exc
            # nothing of this step was applied: run it eagerly
            self._graph_failed(f"{type(exc).__name__}: {str(exc)[:300]}")
            self.optimizer.zero_grad(set_to_none=True)  # whatever a half-run step accumulated
            return self.eager_step(batches)
        if graphs.failure is not None:  # the capture failed after its warm-up step was applied
            self._graph_failed(graphs.failure)
        return res

    def enable_cuda_graphs(self, warmup: int) -> None:
        """Run the step as a CUDA graph from now on: ``warmup`` eager steps, then capture and replay
        (:mod:`hydra_train.graphed_step`). Enabling again starts afresh (a new capture). Under DDP
        the gradients are averaged by hand from now on, eager warm-up steps included (DDP's
        reducer cannot be captured; :mod:`hydra_train.data_parallel`)."""
        from hydra_train.graphed_step import GraphedStep

        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
        self.cuda_graphs = GraphedStep(self, warmup)
        self.sync_grad_averager()

    def disable_cuda_graphs(self) -> None:
        """Back to the eager step: the graph released, the optimizer's lr a Python float again;
        under DDP its reducer averages again (unless ``--ddp_grad_sync allreduce``)."""
        if self.cuda_graphs is None:
            return
        from hydra_train.graphed_step import make_uncapturable

        self.cuda_graphs.release()
        self.cuda_graphs = None
        self.sync_grad_averager()
        if self.device.type == "cuda":
            make_uncapturable(self.optimizer)

    def sync_grad_averager(self) -> None:
        """Who averages the gradients under DDP, from the one rule: the hand-rolled averaging
        (:mod:`hydra_train.data_parallel`) while a CUDA graph is enabled or with
        ``--ddp_grad_sync allreduce``, else DDP's reducer (no averager)."""
        wanted = self.dist.enabled and (
            self.cfg.runtime.ddp_grad_sync == "allreduce" or self.cuda_graphs is not None
        )
        if not wanted:
            self.grad_averager = None
        elif self.grad_averager is None:
            self.grad_averager = self.new_grad_averager()

    def new_grad_averager(self) -> GradAverager:
        """The hand-rolled gradient averaging for this trainer's DDP model."""
        from hydra_train.data_parallel import GradAverager

        if is_fsdp(self.wrapped):
            raise RuntimeError("the hand-rolled gradient averaging is for DDP; FSDP2 reduces its own shards")
        return GradAverager(self.params, self.model, self.dist.world_size)

    def _graph_failed(self, reason: str) -> None:
        self.disable_cuda_graphs()
        self.graph_failures.append(reason)
        self.callbacks.call("on_graph_failure", self.step + 1, reason)

    def _grad_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The total gradient norm (fp32, before clipping), and the divisor the optimizer is to
        clip with where it clips itself (None: clipped here already, or no clipping)."""
        if all(p.grad is None for p in self.params):
            return torch.zeros((), device=self.device), None
        max_norm = self.cfg.optim.grad_clip
        norm, folded = grad_norm_for_step(self.optimizer, self.params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        norm = norm.float()
        return norm, clip_divisor(norm, max_norm) if folded else None

    def apply_if_finite(self, finite: torch.Tensor, clip: torch.Tensor | None = None) -> None:
        """Step the optimizer unless ``finite`` is False (see the module docstring); ``clip``: the
        divisor a fused Adam clips the gradients with as it steps (``_grad_norm``)."""
        opt = self.optimizer
        if supports_found_inf(opt):
            step_with(opt, clip, (~finite).to(torch.float32))
        elif bool(finite):  # host sync: this optimizer cannot skip on its own
            opt.step()
        self._commit_router_thresholds(finite)

    def _sum_balance_loads(self) -> None:
        """Loss-free MoE balancing: each layer's ``pending_load`` (the assignments the next training
        forward turns into a bias update) summed over ranks, after every micro-batch. Each rank
        counted its own tokens only, and the buffer sync before a step's first forward then gave
        every rank rank 0's count, so the biases followed rank 0's load alone; summed, every rank
        makes one process's update on the combined batch, and the biases stay equal on every rank
        with no broadcast. One all-reduce of a few floats, no host sync (a graph captures it)."""
        if not self.dist.enabled:
            return
        layers = getattr(self.model, "moe_layers", None)
        loads = [m.pending_load for m in layers() if m.balancing == "loss_free"] if layers else []
        if loads:
            coalesced(loads, lambda flat: all_reduce_sum(self.dist, flat))

    def _commit_router_thresholds(self, applied: torch.Tensor) -> None:
        """Causal routing: fold this step's router statistics into the thresholds, summed over
        ranks first so that every rank keeps the same τ (one all-reduce for all of them)."""
        commit = getattr(self.model, "commit_router_thresholds", None)
        if commit is None:
            return
        records = self.model.router_threshold_records()
        if self.dist.enabled and records:
            coalesced(records, lambda flat: all_reduce_sum(self.dist, flat))
        commit(applied)
