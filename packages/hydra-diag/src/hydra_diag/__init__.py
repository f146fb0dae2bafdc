"""hydra_diag: Diagnostics and benchmarks for HYDRA models, kernels and runs."""

__version__ = "0.1.0"
