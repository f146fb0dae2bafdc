"""One module per fused op: Triton kernels, host launchers, autograd, the PyTorch reference."""
