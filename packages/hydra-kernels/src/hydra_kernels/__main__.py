"""`python -m hydra_kernels` runs the same app as the `hydra-kernels` console script."""

from hydra_kernels.cli import app
from hydra_kernels.cli_support import run_app

if __name__ == "__main__":
    run_app(app, prog_name="hydra-kernels")
