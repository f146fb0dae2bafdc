"""``--experimental_cuda_graphs``: the trainer's whole step captured as a CUDA graph and replayed.

The graph is the trainer's own (:mod:`hydra_train.graphed_step`: what capture needs and how it is
met); this optimization switches it on (``Trainer.enable_cuda_graphs``: with
``--cuda_graphs_warmup`` W, W−1 eager steps, then the W-th runs for real on the capture stream and
is captured right after) and off (``disable_cuda_graphs``: the graph and its
memory pool released, the gradients back to None, the learning rate a Python float again: the
next step is eager). A graph that fails to capture or replay is dropped by the trainer, which tells
the callbacks (``on_graph_failure``); SafeOptimizations then records it DISABLED with the reason.

Under torchrun with DDP the graph holds the gradient averaging too (``enable_cuda_graphs`` switches
the trainer to :class:`hydra_train.data_parallel.GradAverager`, ``disable_cuda_graphs`` back to
DDP's reducer); FSDP2, ``--ddp_grad_sync reducer`` and ``find_unused_parameters`` make it N/A
(:func:`hydra_train.data_parallel.why_not_graphed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hydra_train.data_parallel import why_not_graphed
from hydra_train.graphed_step import CaptureError, GraphedStep, make_capturable, make_uncapturable
from hydra_train.safe_opts.registry import Optimization
from hydra_train.step import supports_found_inf

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer

__all__ = ["CaptureError", "CudaGraphs", "GraphedStep", "make_capturable", "make_uncapturable"]


class CudaGraphs(Optimization):
    name = "cuda_graphs"
    flag = "--experimental_cuda_graphs"
    title = "the whole training step captured as one CUDA graph and replayed"
    pretest_extra_warmup = 1  # the first replay, right after the capture, is not timed
    probe_differs = False

    def __init__(self, cfg):
        super().__init__(cfg)
        #: warmup steps of the next activation (pretests use fewer than --cuda_graphs_warmup)
        self.warmup = cfg.optimizations.cuda_graphs_warmup
        self._graphs: GraphedStep | None = None  # the last one activated, for describe()

    def requested(self) -> bool:
        return self.cfg.optimizations.experimental_cuda_graphs

    def not_applicable(self, trainer: Trainer) -> str | None:
        if trainer.device.type != "cuda":
            return "needs CUDA"
        if trainer.dist.enabled:
            why = why_not_graphed(self.cfg)
            if why is not None:
                return why
        if not supports_found_inf(trainer.optimizer):
            return "needs torch's fused AdamW (bitsandbytes' AdamW8bit cannot skip a step on the device)"
        return None

    def activate(self, trainer: Trainer) -> None:
        trainer.enable_cuda_graphs(self.warmup)
        self._graphs = trainer.cuda_graphs
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        trainer.disable_cuda_graphs()
        self.active = False

    def invalidate(self, trainer: Trainer) -> None:
        """What the step computes changed: drop the graph, warm up and capture again."""
        if self.active and trainer.cuda_graphs is not None:
            trainer.enable_cuda_graphs(self.warmup)
            self._graphs = trainer.cuda_graphs

    def describe(self) -> dict[str, Any]:
        g = self._graphs
        return {"warmup": self.warmup, **({"captures": g.captures, "replays": g.replays} if g else {})}
