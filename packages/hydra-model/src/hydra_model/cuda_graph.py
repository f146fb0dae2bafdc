"""Whole-step CUDA graph capture for fixed-shape training steps.

A HYDRA training step in dynamic (expert-choice) routing mode has fixed shapes and no host
synchronisation: k = ⌈capacity·n⌉ is a Python int and every routing decision stays on the GPU.
Its cost in eager mode is mostly the host launching several thousand small kernels (routers,
gathers, norms, the recursions' short sub-sequences). Recording the whole step once — forward,
backward and optimizer update — and replaying it removes that launch cost: the GPU then runs
the kernels back to back.

:class:`CUDAGraphStep` is the mechanism, independent of what the step does::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=True)

    def train_step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens[:, :-1], targets=tokens[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    step = CUDAGraphStep(train_step, first_batch)   # runs `warmup` real steps, then captures
    for batch in loader:
        loss = step(batch)                          # copy batch in, replay; loss is a graph output

Requirements (the capture fails loudly otherwise, nothing falls back silently): CUDA tensors of
the shapes given at capture; no host syncs inside ``fn`` (``.item()``, ``nonzero``, printing a
tensor); an optimizer built with ``capturable=True``; the learning rate changed only through
tensors the graph reads (or not at all). Outputs are the graph's own buffers, overwritten by the
next replay: clone what you keep. Eval-mode and token-choice routing, and MoE on its masked
fallback, are also fixed-shape; the per-expert loop of the MoE fallback is not (it syncs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CUDAGraphStep:
    """Capture ``fn(*inputs)`` once as a CUDA graph; each call copies new inputs into the
    captured input buffers and replays it. ``warmup`` untimed real calls run first on a side
    stream (lazy initialisation, autotuning and kernel compilation must not happen during
    capture); they are real steps: an optimizer inside ``fn`` updates the weights each time."""

    def __init__(self, fn: Callable[..., Any], *example_inputs: torch.Tensor, warmup: int = 3) -> None:
        if not example_inputs or any(
            not isinstance(t, torch.Tensor) or not t.is_cuda for t in example_inputs
        ):
            raise ValueError("CUDAGraphStep needs at least one input, and every input must be a CUDA tensor")
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager call must run before the capture")
        self.fn = fn
        self.static_inputs = [t.detach().clone() for t in example_inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # the warm-up's activations sit in the ordinary allocator's cache; the graph takes its
        # own pool, so hand them back first rather than hold both
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = fn(*self.static_inputs)
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(
                    f"input {tuple(src.shape)} {src.dtype} differs from the captured "
                    f"{tuple(dst.shape)} {dst.dtype}: a CUDA graph replays fixed shapes; capture another"
                )
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.static_outputs
