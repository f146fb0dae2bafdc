"""hydra_model: The HYDRA model: CCGQA attention with MoD/MoR/MoE routing, size presets, generation;
and the dense GPT baseline it is judged against (``build_model("gpt", size)``)."""

__version__ = "0.1.0"

from hydra_model.architectures import ARCHITECTURES, arch_of, build_config, build_model
from hydra_model.attention_backend import (
    FLASH_ATTN_AVAILABLE,
    XFORMERS_AVAILABLE,
    attention_autotune_report,
    attention_fallback_counts,
    flexible_attention,
    get_attention_backend,
    reset_attention_fallback_counts,
    same_kernel_as_sdpa,
    set_attention_backend,
)
from hydra_model.blocks import CCGQABlock, CCGQAMoDBlockWrapper, CCGQAMoRBlock
from hydra_model.cache import ModelCache
from hydra_model.ccgqa import CCGQAAttention
from hydra_model.checkpointing import GradientCheckpointMixin
from hydra_model.config import MODEL_PRESETS, SEED_PARAM_COUNTS, HydraConfig, preset_config
from hydra_model.cuda_graph import CUDAGraphStep
from hydra_model.footprint import compute_memory_footprint, flops_breakdown, flops_per_token
from hydra_model.fused_routing import compiled_routing_counts, compiled_routing_enabled, set_compiled_routing
from hydra_model.gpt import GPTLayer, GPTModel, create_gpt_model
from hydra_model.gpt_config import GPT_PRESETS, GPTConfig, gpt_config
from hydra_model.gqa import GQAAttention
from hydra_model.layers import FUSED_KERNELS_AVAILABLE, RMSNorm, RotaryEmbedding, SwiGLUMLP
from hydra_model.model import CCGQAMoDMoRModel, HydraOutput, aux_loss_weights, create_ccgqa_mod_mor_model
from hydra_model.moe import MoEFFN, moe_dispatch_counts
from hydra_model.options import OPTIONS as model_options
from hydra_model.options import ModelOptions
from hydra_model.persistence import load_model
from hydra_model.stats import routing_stats_to_python

__all__ = [
    "ARCHITECTURES",
    "FLASH_ATTN_AVAILABLE",
    "FUSED_KERNELS_AVAILABLE",
    "GPT_PRESETS",
    "MODEL_PRESETS",
    "SEED_PARAM_COUNTS",
    "XFORMERS_AVAILABLE",
    "CCGQAAttention",
    "CCGQABlock",
    "CCGQAMoDBlockWrapper",
    "CCGQAMoDMoRModel",
    "CCGQAMoRBlock",
    "CUDAGraphStep",
    "GPTConfig",
    "GPTLayer",
    "GPTModel",
    "GQAAttention",
    "GradientCheckpointMixin",
    "HydraConfig",
    "HydraOutput",
    "MoEFFN",
    "ModelCache",
    "ModelOptions",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "__version__",
    "arch_of",
    "attention_autotune_report",
    "attention_fallback_counts",
    "aux_loss_weights",
    "build_config",
    "build_model",
    "compiled_routing_counts",
    "compiled_routing_enabled",
    "compute_memory_footprint",
    "create_ccgqa_mod_mor_model",
    "create_gpt_model",
    "flexible_attention",
    "flops_breakdown",
    "flops_per_token",
    "get_attention_backend",
    "gpt_config",
    "load_model",
    "model_options",
    "moe_dispatch_counts",
    "preset_config",
    "reset_attention_fallback_counts",
    "routing_stats_to_python",
    "same_kernel_as_sdpa",
    "set_attention_backend",
    "set_compiled_routing",
]
