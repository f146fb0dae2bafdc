"""What every decoder HYDRA builds offers beyond its forward: FLOP accounting, generation and
persistence, written once for the routed model (model.py) and the dense GPT (gpt.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class DecoderMixin:
    """``flops_per_token``, ``generate``, ``save_pretrained`` and ``from_pretrained`` for a module
    with a ``config`` that footprint.py, generation.py and persistence.py understand."""

    config: Any

    def flops_per_token(self, seq_len: int, executed: bool = True) -> float:
        """Training FLOPs (forward + backward ≈ 3× forward) per token at ``seq_len``, attention
        included; ``executed`` counts only what routing runs (the dense GPT routes nothing),
        otherwise the dense equivalent."""
        from hydra_model.footprint import flops_per_token

        return flops_per_token(self.config, seq_len, executed=executed)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Incremental decoding with the model's cache (keys/values, and CCGQA's conv and
        value-shift state) → [B, S + new]."""
        from hydra_model.generation import generate

        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` (recording the architecture) and ``model.safetensors`` into
        directory ``path``."""
        from hydra_model.persistence import save_pretrained

        return save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path: str | Path, map_location: str | torch.device = "cpu"):
        """Load a directory written by :meth:`save_pretrained` (it must hold this architecture)."""
        from hydra_model.persistence import load_pretrained

        return load_pretrained(cls, path, map_location)
