"""`python -m hydra_diag` runs the same app as the `hydra-diag` console script."""

from hydra_diag.cli import app
from hydra_kernels.cli_support import run_app

if __name__ == "__main__":
    run_app(app, prog_name="hydra-diag")
