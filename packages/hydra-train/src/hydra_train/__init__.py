"""hydra_train: Train HYDRA models: hydra-train run, pretests, metrics database."""

__version__ = "0.1.0"
