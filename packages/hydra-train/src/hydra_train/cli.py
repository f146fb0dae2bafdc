"""The `hydra-train` command line."""

from hydra_kernels.cli_support import add_version_option, new_app
from hydra_train import __version__

app = new_app("Train HYDRA models: hydra-train run, pretests, metrics database.")
add_version_option(app, "hydra-train", __version__)
