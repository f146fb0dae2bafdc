"""The `hydra-kernels` command line."""

from hydra_kernels import __version__
from hydra_kernels.cli_support import add_version_option, new_app

app = new_app("Fused Triton kernels for HYDRA: status, numerical checks, benchmarks.")
add_version_option(app, "hydra-kernels", __version__)
