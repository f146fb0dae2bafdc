"""One training step of a HYDRA model, set up the way benchmarks measure it, on one CUDA GPU.

bf16 autocast, fp32 weights, fused AdamW, random tokens over the model's vocabulary (``B × T+1``,
input and shifted targets), ``loss.backward()``, ``opt.step()``, gradients set to None. Nothing in
the step reads a value back to the host, so timing it with CUDA events measures the GPU's work.
Shared by ``bench model``, ``sweep throughput``/``vram``, both ``profile`` commands and the scripts
in ``packages/hydra-diag/bench/`` that time a whole model step (``bench_model.py`` and the
profilers built on it).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hydra_diag.device_memory import peak_memory, reset_peak_memory
from hydra_diag.output import DiagError

#: Dense bf16 tensor-core peaks (datasheets, FLOP/s) by a substring of the device name.
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
    ("4090", 165e12),
)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from) for MFU; None when the device is not in the table."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16:
        if key in name:
            return value, f"datasheet dense bf16 of {key}"
    return None, f"unknown device {name!r}: pass --peak-tflops for MFU"


def is_oom(exc: BaseException) -> bool:
    """An allocation failure, whichever library hit it first (the caching allocator, cuBLAS, CUDA)."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or any(
        key in text for key in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")
    )


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_model(model, scope: str, *, static_model: bool = False):
    """What the step should call. ``model``: torch.compile of the whole forward (with
    ``dynamic=False`` when ``static_model``: one graph for the fixed benchmark shape); ``blocks``:
    each shared HYDRA block with dynamic shapes (routed lengths vary, one graph serves them all) and
    each dense GPT layer with fixed ones; ``blocks-static``: the blocks with one graph per length,
    which is what hydra-train's ``--compile_scope blocks`` compiles (it compiled sooner there)."""
    from hydra_model import CCGQABlock
    from hydra_train.safe_opts.toggles import allow_block_graphs, compile_options, compile_units

    allow_block_graphs()
    options = compile_options("inductor")  # what hydra-train compiles with
    if scope == "model":
        return torch.compile(model, dynamic=False if static_model else None, options=options)
    if scope in ("blocks", "blocks-static"):
        for unit in compile_units(model):  # HYDRA's blocks and the dense GPT's layers (fixed shapes)
            unit.compile(dynamic=scope == "blocks" and isinstance(unit, CCGQABlock), options=options)
        return model
    raise DiagError(f"--compile-scope {scope!r}: use blocks or model")


def train_step(
    forward, optimizer: torch.optim.Optimizer, data: torch.Tensor, device_type: str
) -> torch.Tensor:
    """One benchmark training step on ``data`` (``B × T+1`` tokens): bf16 autocast on CUDA, the loss
    backward, the optimizer, gradients set to None; returns the detached loss (no host read)."""
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        out = forward(data[:, :-1], targets=data[:, 1:])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


@dataclass
class StepHarness:
    """A model, its optimizer and a few random batches; :meth:`step` runs one training step."""

    model: Any
    forward: Any
    optimizer: torch.optim.Optimizer
    batches: list[torch.Tensor]
    batch_size: int
    seq_len: int
    device: torch.device
    i: int = 0

    @classmethod
    def build(
        cls,
        model,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        n_batches: int = 2,
        compile_scope: str | None = None,
    ) -> StepHarness:
        model = model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        vocab = model.config.vocab_size
        g = torch.Generator(device="cpu").manual_seed(0)
        batches = [
            torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(device)
            for _ in range(n_batches)
        ]
        fwd = compile_model(model, compile_scope) if compile_scope else model
        return cls(model, fwd, opt, batches, batch_size, seq_len, device)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def step(self) -> torch.Tensor:
        data = self.batches[self.i % len(self.batches)]
        self.i += 1
        return train_step(self.forward, self.optimizer, data, self.device.type)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_steps(self, steps: int) -> dict[str, Any]:
        """Median step time over ``steps`` (CUDA events; wall clock on the CPU), the last loss and
        the memory of those steps: ``peak_gib`` (the most the caching allocator held, a CUDA
        graph's private pool included), ``graph_pool_gib`` and ``peak_allocated_gib``, as
        hydra_diag.device_memory defines them (None on the CPU). ``peak_gib`` was the allocated
        peak before; that figure is ``peak_allocated_gib`` now. On CUDA one untimed step runs
        first."""
        cuda = self.device.type == "cuda"
        reset_peak_memory(self.device)
        if cuda:  # what the reset released from the cache is allocated again outside the timing
            self.step()
        marks: list[Any] = []
        losses = []
        for _ in range(steps):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append(ev)
            else:
                marks.append(time.perf_counter())
            losses.append(self.step())
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())
        self.sync()
        if cuda:
            times = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        else:
            times = [(b - a) * 1000 for a, b in itertools.pairwise(marks)]
        ms = statistics.median(times)
        return {
            "step_ms": ms,
            "step_ms_min": min(times),
            "tokens_per_s": self.tokens_per_step / (ms / 1000),
            "final_loss": float(losses[-1]),
            **peak_memory(self.device),
        }
