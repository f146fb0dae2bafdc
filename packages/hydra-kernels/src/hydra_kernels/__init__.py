"""hydra_kernels: fused Triton kernels (forward and backward) with PyTorch references."""

__version__ = "0.1.0"
