"""`python -m hydra_train` runs the same app as the `hydra-train` console script."""

from hydra_kernels.cli_support import run_app
from hydra_train.cli import app

if __name__ == "__main__":
    run_app(app, prog_name="hydra-train")
