"""The `hydra-model` command line."""

from hydra_kernels.cli_support import add_version_option, new_app
from hydra_model import __version__

app = new_app("The HYDRA model: CCGQA attention with MoD/MoR/MoE routing, size presets, generation.")
add_version_option(app, "hydra-model", __version__)
