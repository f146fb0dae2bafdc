"""The `hydra-diag` command line."""

from hydra_diag import __version__
from hydra_kernels.cli_support import add_version_option, new_app

app = new_app("Diagnostics and benchmarks for HYDRA models, kernels and runs.")
add_version_option(app, "hydra-diag", __version__)
