"""One entrant of the race: build, compile and warm up (setup, not timed), then train against the
clock with evaluations at fixed points of training time (clock paused while they run).

Setup: the model is built (seeded), moved to the device, compiled (CUDA: ``torch.compile`` of the
whole model replayed as CUDA graphs by default (``graphs``; ``model`` compiles without graphs,
which leaves HYDRA's many small kernels waiting on the host); ``blocks`` compiles each
attention+FFN block with static shapes (a graph per row count), as hydra-train's
``--compile_scope blocks`` does; the CPU runs eager fp32), and ``warmup_steps`` training steps
run so that compilation and autotuning happen now. Then every parameter and buffer is copied
back IN PLACE to its value from before the warm-up (compiled code keeps referencing the same
tensors), the optimizer is built afresh and the clock starts. ``setup_s`` is all of that.

Training step: bf16 autocast on CUDA, ``out.loss.backward()`` (CE plus the model's weighted
auxiliary losses; on CUDA the fused chunked linear + CE for every entrant, as hydra-train
defaults there: :func:`build_entrant`), gradient-norm clip, AdamW (betas 0.9/0.95, weight decay
on matrices only, fused on CUDA; hydra-train's ``build_optimizer``, the fused one clipping as it
steps: ``clip_and_step``), learning rate from :mod:`hydra_diag.race.schedule` at the clock's
reading; HYDRA's causal routing thresholds are committed at the start of the next
training forward (the model's default), inside the compiled code. Batches are built and pinned
one to four steps ahead by a worker thread (hydra-train's Prefetcher). Nothing is read back to
the host per step; the clock is read on the host and ``torch.cuda.synchronize()`` runs at every clock boundary
(evaluations, the end), so the recorded training seconds include all GPU work of the steps.

Evaluation calls the module itself, not the ``torch.compile`` wrapper (the same parameters; no
whole-model graphs traced for evaluation; with ``blocks`` the compiled blocks are inside the module
and compile their evaluation variants on first use, outside the clock). It runs in
``model.eval()`` (the routing generation uses) and, for routed models, ``model.train()`` under
``torch.no_grad()``; parameters and buffers are restored after the training-mode pass, so routing
state that a training-mode forward updates (thresholds, balancing biases) is left untouched.

Recompilations after the warm-up (shapes that change during training) happen on the clock and are
counted in it: they are a cost of the model. ``graphs_compiled_in_training`` says how many there were.

Memory: ``peak_gib``, ``graph_pool_gib`` and ``peak_allocated_gib`` (:mod:`hydra_diag.device_memory`)
from the end of setup through training and its evaluations; ``peak_gib`` includes the CUDA graphs'
private pool and the blocks the warm-up left cached (the cache is not emptied before the clock).
Entries written before these fields have ``peak_memory_gib``, which was ``max_memory_allocated``
over the same stretch: ``peak_allocated_gib``, not the step's memory under the graphs scope.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from hydra_diag.device_memory import peak_memory, reset_peak_memory
from hydra_diag.race.configs import RaceConfig
from hydra_diag.race.data import RaceData
from hydra_diag.race.schedule import lr_factor

BETAS = (0.9, 0.95)


@dataclass
class RaceSettings:
    model_size: str
    budget_s: float
    evals: int = 6
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 3
    seed: int = 1337
    compile: bool = True
    log_every_s: float = 10.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "betas": list(BETAS)}


def graphs_compiled() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _state_tensors(model).items()}


@torch.no_grad()
def restore(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy ``saved`` back into the model's own tensors, in place (compiled code keeps its refs)."""
    for k, v in _state_tensors(model).items():
        v.copy_(saved[k])
    for p in model.parameters():
        p.grad = None


def build_entrant(
    cfg: RaceConfig, model_size: str, vocab_size: int, seq_len: int, device: torch.device | None = None
) -> torch.nn.Module:
    """``cfg``'s model (on the CPU). On a CUDA ``device`` its loss is the fused chunked linear +
    cross-entropy unless ``cfg`` sets ``use_chunked_ce``: hydra-train's default there, for every
    entrant alike (on an H100 it took 0.3 ms off HYDRA's 25.7 ms step and the GPT's 33.3 ms:
    packages/hydra-model/BENCHMARKS.md)."""
    from hydra_model.architectures import build_config, build_model

    extra: dict[str, Any] = {"vocab_size": vocab_size}
    if device is not None and device.type == "cuda":
        extra["use_chunked_ce"] = True
    # a max_seq_len below the race's windows can only crash the first step; the table's entries
    # that copy a 100M preset carry its 2048, so an override does not stop the raise either
    over = dict(cfg.overrides)
    if build_config(cfg.arch, model_size, **over).max_seq_len < seq_len:
        over["max_seq_len"] = seq_len
    return build_model(cfg.arch, model_size, **{**extra, **over})


def compile_entrant(model: torch.nn.Module, scope: str):
    """What the step calls: the compiled model, or the model with its blocks compiled (one graph
    per row count); as the benchmark harness compiles, with the inductor options hydra-train
    compiles with (both entrants alike: a shorter setup, the same steady speed,
    packages/hydra-train/BENCHMARKS.md)."""
    from hydra_diag.harness import compile_model
    from hydra_train.safe_opts.toggles import allow_block_graphs, compile_options

    if scope == "graphs":  # the whole model compiled and replayed as CUDA graphs (static shapes)
        allow_block_graphs()
        # what mode="reduce-overhead" sets; torch.compile takes a mode or options, not both
        return torch.compile(model, options={**compile_options("inductor"), "triton.cudagraphs": True})
    return compile_model(model, "blocks-static" if scope == "blocks" else scope)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def evaluate(model, batches, device: torch.device, train_mode: bool) -> float:
    """Mean validation CE per token over ``batches`` with training- or inference-mode routing."""
    was = model.training
    saved = snapshot(model) if train_mode else None
    model.train(train_mode)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        with autocast(device):
            for x, y in batches:
                out = model(x.to(device), targets=y.to(device))
                total += out.ce_loss.double() * y.numel()
                count += y.numel()
    finally:
        if saved is not None:
            restore(model, saved)
        model.train(was)
    return float(total.item() / count)


def race_one(
    cfg: RaceConfig,
    data: RaceData,
    s: RaceSettings,
    device: torch.device,
    say: Callable[[str], None],
    tick: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Race ``cfg`` for ``s.budget_s`` seconds of training; the per-configuration result."""
    from hydra_model.fused_routing import compiled_routing_enabled, set_compiled_routing
    from hydra_train.optim import build_optimizer, clip_and_step
    from hydra_train.prefetch import Prefetcher
    from hydra_train.step import loss_only_kwargs

    cuda = device.type == "cuda"
    t_setup = time.perf_counter()
    # where setup goes: seconds from the start of setup to each progress message (the last phase
    # ends at setup_s); the phases are the messages below
    phases: list[tuple[str, float]] = []
    outer_say = say

    def say(msg: str) -> None:
        if setup_s is None:
            phases.append((msg, time.perf_counter() - t_setup))
        outer_say(msg)

    setup_s: float | None = None
    torch.manual_seed(s.seed)
    say("building")
    model = build_entrant(cfg, s.model_size, data.vocab_size, data.seq_len, device).to(device).train()
    n_params = int(model.num_parameters())
    fpt = float(model.flops_per_token(data.seq_len, executed=True))
    fpt_dense = float(model.flops_per_token(data.seq_len, executed=False))
    initial = snapshot(model)
    val = data.val_batches()
    if cuda:
        # eager passes first, in every mode the race will use: the attention backend measures
        # its kernels per shape on eager calls and keeps the picks in a table that compiled code
        # reads; filling it after compiling made the first timed step recompile (on the H200
        # 2026-11-23: 25-45 s of HYDRA's 120 s budget)
        say("measuring attention kernels (eager)")
        x, y = data.batch(0)
        # the routing glue op by op here: its own compiled copies (fused_routing.py) would cost
        # ~15 s of compiling (H100, 2026-11-25, warm cache too) for a pass that only measures
        # attention; the compiled entrant traces the glue into its own graph anyway
        glue = compiled_routing_enabled()
        set_compiled_routing(False)
        try:
            with autocast(device):
                model(x.to(device), targets=y.to(device)).loss.backward()
            evaluate(model, val[:1], device, train_mode=False)
            evaluate(model, val[:1], device, train_mode=True)
        finally:
            set_compiled_routing(glue)
        restore(model, initial)
    scope = cfg.compile if (cuda and s.compile) else "none"
    fwd = compile_entrant(model, scope) if scope != "none" else model
    params = [p for p in model.parameters() if p.requires_grad]
    # the losses alone, as hydra-train's step asks: logits returned by a compiled forward would
    # get a zero gradient the size of the logits in its backward (hydra_model.decoder)
    forward_kwargs = loss_only_kwargs(model)
    # causal routing thresholds move once per optimizer step: the model's default commits the
    # last step's record at the start of the next training forward, inside the compiled (and
    # graphed) code; committing eagerly after the step instead cost ~40 small launches per routing
    # point, host time that an H100 profile (race_profile.py) showed the GPU waiting on

    def new_optimizer():
        return build_optimizer(model, lr=cfg.lr, weight_decay=s.weight_decay, betas=BETAS, log=say)

    def step(batch, opt, lr: float) -> torch.Tensor:
        x, y = batch
        for g in opt.param_groups:
            g["lr"] = lr
        if scope == "graphs":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten
        with autocast(device):
            out = fwd(x, targets=y, **forward_kwargs)
        out.loss.backward()
        clip_and_step(opt, params, s.grad_clip)  # fused AdamW clips as it steps
        opt.zero_grad(set_to_none=True)
        return out.ce_loss.detach().clone()  # a graph replay reuses the output's memory

    choice = new_optimizer()
    for i in range(s.warmup_steps):
        say(f"warm-up step {i + 1}/{s.warmup_steps} (compiling)" if scope != "none" else "warm-up")
        step(tuple(t.to(device) for t in data.batch(i)), choice.optimizer, cfg.lr * 0.01)
    say("evaluation warm-up" + (" (compiling)" if scope != "none" else ""))
    evaluate(model, val[:1], device, train_mode=False)
    _sync(device)
    restore(model, initial)
    del choice, initial
    choice = new_optimizer()
    opt = choice.optimizer
    # the peaks start after the warm-up (compiled, graphs captured); the cache is kept, so the
    # clock's first step finds its blocks as every later one does (peak_gib counts them too)
    reset_peak_memory(device, release_cache=False)
    _sync(device)
    setup_s = time.perf_counter() - t_setup
    graphs_at_start, eval_graphs = graphs_compiled(), [0]

    tokens_per_step = data.batch_size * data.seq_len
    marks = [s.budget_s * i / s.evals for i in range(1, s.evals + 1)]
    evals: list[dict[str, Any]] = []
    status, k, clock = "ok", 0, 0.0
    recent: list[torch.Tensor] = []
    last_lr = [0.0]
    last_train_loss: float | None = None

    def record(clock_s: float) -> None:
        say(f"evaluating at {clock_s:.0f} s")
        g0 = graphs_compiled()
        ev = evaluate(model, val, device, train_mode=False)
        tr = evaluate(model, val, device, train_mode=True) if cfg.routed else None
        evals.append(
            {
                "elapsed_s": clock_s,
                "steps": k,
                "tokens": k * tokens_per_step,
                "flops": k * tokens_per_step * fpt,
                "epochs": data.epochs(k),
                "lr": last_lr[0],  # what the last step used: peak × f(clock at that step's start)
                "train_loss": last_train_loss,
                "val_loss": ev,
                "val_loss_train_mode": tr,
            }
        )
        eval_graphs[0] += graphs_compiled() - g0

    record(0.0)
    # batch k is built and pinned by a worker thread while the GPU runs earlier steps (the same
    # batches in the same order: BatchPlan.batch(k) is a pure function of k); inline, a fast
    # model's step waited on the host's slicing and pinning
    batches = Prefetcher(data.batch, 0, threads=1, buffer_size=4, device=device)
    try:  # the worker and its pinned buffers go with the entrant, also on an error
        next_mark, last_log = 0, time.perf_counter()
        seg = time.perf_counter()
        while True:
            now = clock + time.perf_counter() - seg
            if now >= marks[next_mark] or status != "ok":
                _sync(device)
                clock += time.perf_counter() - seg
                if recent:
                    last_train_loss = float(torch.stack(recent).float().mean())
                    recent.clear()
                record(clock)
                next_mark += 1
                tick(
                    {
                        "clock": clock,
                        "tokens": k * tokens_per_step,
                        "loss": last_train_loss,
                        "eval": evals[-1],
                    }
                )
                if next_mark == len(marks) or status != "ok":
                    break
                seg = time.perf_counter()
                continue
            lr = cfg.lr * lr_factor(now, s.budget_s, s.warmup_frac, s.min_lr_ratio)
            loss = step(batches.next(), opt, lr)
            last_lr[0] = lr
            k += 1
            recent.append(loss)
            if len(recent) > 64:
                recent.pop(0)
            if time.perf_counter() - last_log >= s.log_every_s:
                last_log = time.perf_counter()
                last_train_loss = float(loss)  # one host read per log interval
                if not math.isfinite(last_train_loss):
                    status = "diverged"
                at = clock + time.perf_counter() - seg  # host time: the GPU may still be a step or two behind
                tick({"clock": at, "tokens": k * tokens_per_step, "loss": last_train_loss, "lr": lr})
    finally:
        batches.close()
    result = {
        **cfg.to_dict(),
        "status": status if all(math.isfinite(e["val_loss"]) for e in evals) else "diverged",
        "compile": scope,
        "optimizer": choice.name,
        "chunked_ce": bool(getattr(model.config, "use_chunked_ce", False)),
        "params": n_params,
        "flops_per_token": fpt,
        "flops_per_token_dense": fpt_dense,
        "setup_s": setup_s,
        "setup_phases": [
            {"phase": msg, "start_s": start, "seconds": end - start}
            for (msg, start), end in zip(phases, [p[1] for p in phases[1:]] + [setup_s], strict=True)
        ],
        "train_s": clock,
        "steps": k,
        "tokens": k * tokens_per_step,
        "tokens_per_s": k * tokens_per_step / clock if clock > 0 else None,
        "epochs": data.epochs(k),
        **peak_memory(device),  # older entries: peak_memory_gib (the module's docstring, Memory)
        "final_val_loss": evals[-1]["val_loss"],
        "final_val_loss_train_mode": evals[-1]["val_loss_train_mode"],
        "final_train_loss": last_train_loss,
        # recompilations inside the timed part (new shapes after the warm-up) are counted in the
        # clock; this says whether there were any (0 for a static-shape model)
        "graphs_compiled_in_training": graphs_compiled() - graphs_at_start - eval_graphs[0],
        "evals": evals,
    }
    return result  # the caller releases memory once this frame (model, optimizer) is gone


def release(device: torch.device) -> None:
    """Free the last entrant's memory and compiled code (the next one compiles from scratch)."""
    gc.collect()
    if device.type == "cuda":
        import torch._dynamo

        torch._dynamo.reset()
        torch.cuda.empty_cache()
