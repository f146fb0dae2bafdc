"""The optimizations that are a switch somewhere in the stack: attention backend, static routing,
Blackwell launch tuning, background prefetch, Triton kernels, torch.compile.

Each one's safe default, what ``deactivate`` restores:

==================  ===========================================================================
fa3                 ``set_attention_backend("sdpa")``: PyTorch's own SDPA kernel choice
static_routing      the configured dynamic routing (top-k MoD, expert-choice MoR)
blackwell_tuning    ``set_blackwell_tuning(False)``: the op tables' generic launch entries
prefetch_threads    batches built inline by the trainer's thread
triton_kernels      ``set_use_triton_kernels(False)``: the PyTorch references
compile             the eager modules
==================  ===========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hydra_train.distributed import is_fsdp
from hydra_train.options import train_options
from hydra_train.prefetch import Prefetcher
from hydra_train.safe_opts.registry import THROUGHPUT_DROP, Optimization

if TYPE_CHECKING:
    from hydra_train.trainer import Trainer


class FlashAttention(Optimization):
    name = "fa3"
    flag = "--experimental_fa3"
    title = "flash-attn 3/2 when installed, else the fastest SDPA kernel measured for the shapes"

    def requested(self) -> bool:
        return self.cfg.optimizations.experimental_fa3

    def not_applicable(self, trainer: Trainer) -> str | None:
        pinned = train_options().pinned_attention_backend
        if pinned:
            return f"HYDRA_ATTENTION_BACKEND={pinned} is set: the environment chooses the backend"
        if trainer.device.type != "cuda":
            return "needs CUDA (off CUDA every backend is plain SDPA)"
        return None

    def activate(self, trainer: Trainer) -> None:
        from hydra_model import FLASH_ATTN_AVAILABLE, set_attention_backend

        # "auto" measures every present kernel (flash-attn included) per shape and keeps the fastest
        set_attention_backend("flash" if FLASH_ATTN_AVAILABLE else "auto")
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        from hydra_model import set_attention_backend

        if not train_options().pinned_attention_backend:
            set_attention_backend("sdpa")
        self.active = False

    def describe(self) -> dict[str, Any]:
        from hydra_model import FLASH_ATTN_AVAILABLE, attention_autotune_report, same_kernel_as_sdpa

        reports = [r for r in attention_autotune_report().values() if "chosen" in r]
        picks = sorted({str(r["chosen"]) for r in reports})
        same = bool(reports) and all(same_kernel_as_sdpa(r) for r in reports)
        return {
            "flash_attn_installed": FLASH_ATTN_AVAILABLE,
            "auto_picked": picks,
            "same_kernels_as_sdpa": same,
        }

    def no_effect(self, described: dict[str, Any]) -> str | None:
        # auto measured every shape the arm ran and picked what plain SDPA dispatches to itself:
        # the default arm ran the same kernels, so a speed verdict would judge the host's noise
        # (on an H100 this arm failed on speed while both ran cuDNN's kernel,
        # packages/hydra-model/BENCHMARKS.md, 2026-11-26)
        if described.get("flash_attn_installed") is False and described.get("same_kernels_as_sdpa"):
            picks = ", ".join(described.get("auto_picked", []))
            return f"auto picked the kernels plain SDPA runs itself, at every shape ({picks}): no change"
        return None


def routing_wrappers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from hydra_model import CCGQAMoDBlockWrapper

    return [m for m in model.modules() if isinstance(m, CCGQAMoDBlockWrapper)]


def set_static_routing(model: torch.nn.Module, on: bool) -> None:
    """Soft routing (every token through every block and recursion) on or off, in place.
    The blocks keep their parameters; only the routing rule they apply changes."""
    for blk in routing_wrappers(model):
        blk.static = on
        if blk.mor.mode != "dense":
            blk.mor.mode = "static" if on else blk.mor.dynamic_mode


class StaticRouting(Optimization):
    name = "static_routing"
    flag = "--static_routing_mode"
    title = "soft routing: every token through every block (fixed, dense compute)"
    numerics = "mode"

    def requested(self) -> bool:
        # the flag, or the same HydraConfig field set through --model_override
        return bool(
            self.cfg.model.static_routing_mode or self.cfg.model.model_overrides.get("static_routing_mode")
        )

    def not_applicable(self, trainer: Trainer) -> str | None:
        cfg = getattr(trainer.model, "config", None)
        if cfg is None or not routing_wrappers(trainer.model):
            return "the model has no HYDRA routing blocks"
        if cfg.routing_off:
            return "the dense baseline has no routing"
        return None

    def activate(self, trainer: Trainer) -> None:
        set_static_routing(trainer.model, True)
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        if routing_wrappers(trainer.model):
            set_static_routing(trainer.model, False)
        self.active = False


class BlackwellTuning(Optimization):
    name = "blackwell_tuning"
    flag = "--experimental_blackwell_tuning"
    title = "hydra-kernels' Blackwell launch table (+ --triton_block_q/--triton_block_kv/--triton_num_warps)"

    def requested(self) -> bool:
        return self.cfg.optimizations.experimental_blackwell_tuning

    def overrides(self) -> dict[str, int]:
        c = self.cfg
        vals = {"block_q": c.triton_block_q, "block_kv": c.triton_block_kv, "num_warps": c.triton_num_warps}
        return {k: v for k, v in vals.items() if v is not None}

    def not_applicable(self, trainer: Trainer) -> str | None:
        if trainer.device.type != "cuda":
            return "for sm_100/sm_120 GPUs; this run is on the CPU"
        major, minor = torch.cuda.get_device_capability(trainer.device)
        if major < 10:
            return f"for sm_100/sm_120 GPUs; this one is sm_{major}{minor}"
        return None

    def activate(self, trainer: Trainer) -> None:
        from hydra_kernels.launch_config import set_blackwell_tuning, set_launch_overrides

        set_blackwell_tuning(True)
        if self.overrides():
            set_launch_overrides(None, **self.overrides())
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        from hydra_kernels.launch_config import clear_launch_overrides, set_blackwell_tuning

        set_blackwell_tuning(False)
        if self.overrides():
            clear_launch_overrides()
        self.active = False

    def describe(self) -> dict[str, Any]:
        return {"overrides": self.overrides()}


class PrefetchThreads(Optimization):
    name = "prefetch_threads"
    flag = "--experimental_prefetch_threads"
    title = "background threads build the next batches while the GPU works"
    # batches are a pure function of their index: threads change when a batch is built, never what
    # it holds, so only a throughput drop can be blamed on them
    causes = frozenset({THROUGHPUT_DROP})
    probe_differs = False

    def requested(self) -> bool:
        return self.cfg.optimizations.experimental_prefetch_threads > 0

    def _swap_loader(self, trainer: Trainer, threads: int) -> None:
        old = trainer.loader
        if old.threads == threads:
            return
        trainer.loader = Prefetcher(
            old.make_batch,
            old.position,
            threads=threads,
            buffer_size=self.cfg.optimizations.prefetch_buffer_size,
            device=old.device,
        )
        old.close()

    def activate(self, trainer: Trainer) -> None:
        self._swap_loader(trainer, self.cfg.optimizations.experimental_prefetch_threads)
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        self._swap_loader(trainer, 0)
        self.active = False

    def describe(self) -> dict[str, Any]:
        return {
            "threads": self.cfg.optimizations.experimental_prefetch_threads,
            "buffer": self.cfg.optimizations.prefetch_buffer_size,
        }


class TritonKernels(Optimization):
    name = "triton_kernels"
    flag = "--triton_kernels"
    title = "hydra-kernels' fused Triton ops instead of the PyTorch references"

    def requested(self) -> bool:
        return self.cfg.optimizations.triton_kernels

    def not_applicable(self, trainer: Trainer) -> str | None:
        from hydra_kernels.controls import TRITON_AVAILABLE, device_supports_triton

        if not TRITON_AVAILABLE:
            return "Triton is not importable here"
        if not device_supports_triton(trainer.device):
            return "needs CUDA (on the CPU only under TRITON_INTERPRET=1)"
        return None

    def activate(self, trainer: Trainer) -> None:
        from hydra_kernels import set_use_triton_kernels

        set_use_triton_kernels(True)
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        from hydra_kernels import set_use_triton_kernels

        set_use_triton_kernels(False)
        self.active = False


#: dynamo's cache entries a compiled block may hold: a graph per row count, grad mode and batch
#: size (a partial last evaluation batch); a shape beyond it would run eagerly. The limit is
#: process-wide (torch._dynamo.config.cache_size_limit), raised to this and never lowered
BLOCK_GRAPHS_LIMIT = 64


#: inductor options of every compile hydra-train makes (``--compile``, fp8's fused quantize).
#: Pointwise kernels take inductor's one default launch configuration instead of compiling two and
#: timing them at the first call: on an H100, HYDRA 100M's whole forward compiled 832 Triton kernels
#: instead of 1336, timed 6 instead of 129, and stepped as fast
#: (packages/hydra-train/BENCHMARKS.md, 2026-11-27). Combo kernels: inductor launches independent
#: small kernels as one. On an H100 the race's graphed 100M step went from 1095 to 920 kernels and
#: from 26.52 to 26.15 ms for HYDRA, 33.96 to 33.79 ms for the dense GPT (hydra-model's
#: BENCHMARKS.md); `hydra-train run`'s cold compile arm took 34.3 and 38.4 s against 33.3 s
#: without (this package's BENCHMARKS.md, both 2026-11-27). Coordinate-descent tuning was measured
#: too and left off: the whole-model compile did not finish in 150 s.
INDUCTOR_OPTIONS: dict[str, Any] = {"triton.autotune_pointwise": False, "combo_kernels": True}


def compile_options(backend: str) -> dict[str, Any] | None:
    """``torch.compile``'s ``options`` for ``backend``: :data:`INDUCTOR_OPTIONS` for inductor
    (other backends take none)."""
    return dict(INDUCTOR_OPTIONS) if backend == "inductor" else None


def allow_block_graphs() -> None:
    """Raise dynamo's process-wide cache limit to :data:`BLOCK_GRAPHS_LIMIT` (never lower it):
    what any caller compiling blocks one graph per shape needs (hydra-diag's race and bench too)."""
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, BLOCK_GRAPHS_LIMIT)


def compile_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``--compile_scope blocks`` compiles: every CCGQABlock (attention + FFN), the unit
    each recursion applies; in the dense GPT every layer (norms, attention, MLP)."""
    from hydra_model import CCGQABlock, GPTLayer

    return [m for m in model.modules() if isinstance(m, (CCGQABlock, GPTLayer))]


class CompileModel(Optimization):
    """``torch.compile``, on by default for a long CUDA run
    (``hydra_train.compile_defaults.compile_by_default``).
    Scope ``blocks`` compiles each CCGQABlock (attention + FFN), the unit every recursion applies,
    with static shapes: one graph per row count a block sees (the full length, each routed
    capacity; fixed by the config) and batch size, shared by all blocks, so compile time does not grow with
    depth. On an H200 the 100M preset's two static graphs compiled in 11 s on a cold cache,
    one dynamic-shape graph in 19 s (packages/hydra-train/BENCHMARKS.md, 2026-11-26). The
    routing glue around the blocks is hydra-model's own business (it compiles its fused routing
    functions itself). Scope ``model`` compiles the whole forward (the DDP wrapper when there is
    one). ``HYDRA_COMPILE_BACKEND`` picks the backend (default inductor)."""

    name = "compile"
    flag = "--compile"
    title = "torch.compile (--compile_scope blocks: each attention+FFN block; model: the whole forward)"
    # the trace reads these switches: pretested with them on, the run reuses the compiled code
    pretest_on_top_of = ("triton_kernels", "fa3")

    def __init__(self, cfg):
        super().__init__(cfg)
        self._compiled: dict[int, Any] = {}  # id(module) -> its compiled callable, reused on re-activation

    @property
    def backend(self) -> str:
        return train_options().compile_backend

    def requested(self) -> bool:
        return self.cfg.optimizations.compile

    def not_applicable(self, trainer: Trainer) -> str | None:
        if self.cfg.optimizations.compile_scope == "blocks" and not compile_units(trainer.model):
            return "--compile_scope blocks needs HYDRA blocks; use --compile_scope model"
        return None

    def activate(self, trainer: Trainer) -> None:
        if self.cfg.optimizations.compile_scope == "model":
            key = id(trainer.wrapped)
            if key not in self._compiled:
                self._compiled[key] = torch.compile(
                    trainer.wrapped, backend=self.backend, options=compile_options(self.backend)
                )
            trainer.forward_model = self._compiled[key]
        else:
            # one graph per row count (the full length and each routed capacity, in training's
            # and evaluation's grad modes): room for all of them in dynamo's cache
            allow_block_graphs()
            for blk in compile_units(trainer.model):
                sharded = is_fsdp(blk)  # an FSDP2 unit: its __call__ gathers and reshards
                if id(blk) not in self._compiled:
                    # an FSDP2 unit's hooks (all-gather, reshard) stay eager around its compiled
                    # forward, where torchtitan keeps them too; dynamo would break its graph on them
                    fn = blk.forward if sharded else blk._call_impl
                    self._compiled[id(blk)] = torch.compile(
                        fn, backend=self.backend, dynamic=False, options=compile_options(self.backend)
                    )
                if sharded:
                    blk.forward = self._compiled[id(blk)]  # an instance attribute over the method
                else:
                    # what nn.Module.compile() sets: __call__ goes through it while it is not None
                    blk._compiled_call_impl = self._compiled[id(blk)]
        self.active = True

    def deactivate(self, trainer: Trainer) -> None:
        trainer.forward_model = trainer.wrapped
        for blk in compile_units(trainer.model):
            blk._compiled_call_impl = None
            blk.__dict__.pop("forward", None)
        self.active = False

    def invalidate(self, trainer: Trainer) -> None:
        """Another optimization swapped modules or a switch the trace read: compile afresh rather
        than trust that every guard noticed (a class swap or a global read may not be guarded)."""
        if self.active:
            self.deactivate(trainer)
            torch._dynamo.reset()
            self._compiled.clear()
            self.activate(trainer)

    def describe(self) -> dict[str, Any]:
        return {"scope": self.cfg.optimizations.compile_scope, "backend": self.backend}
