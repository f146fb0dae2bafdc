"""hydra_model: The HYDRA model: CCGQA attention with MoD/MoR/MoE routing, size presets, generation."""

__version__ = "0.1.0"
