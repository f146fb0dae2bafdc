"""Whole-step CUDA graph capture for fixed-shape training steps.

A HYDRA training step in dynamic (expert-choice) routing mode has fixed shapes and no host
synchronisation: k = ⌈capacity·n⌉ is a Python int and every routing decision stays on the GPU.
Its cost in eager mode is mostly the host launching several thousand small kernels (routers,
gathers, norms, the recursions' short sub-sequences); recording the whole step once and replaying
it removes that launch cost. Eval-mode and token-choice routing, and MoE on its masked fallback,
are also fixed-shape; the per-expert loop of the MoE fallback is not (it syncs).

The mechanism is :class:`hydra_kernels.cuda_graph.CUDAGraphStep` (its docstring shows a whole
training step captured), HYDRA's capture of whole steps; it is importable from here as well.
Decoding captures its stages itself (decode_graphs.py).
"""

from hydra_kernels.cuda_graph import CUDAGraphStep

__all__ = ["CUDAGraphStep"]
