"""`python -m hydra_model` runs the same app as the `hydra-model` console script."""

from hydra_kernels.cli_support import run_app
from hydra_model.cli import app

if __name__ == "__main__":
    run_app(app, prog_name="hydra-model")
