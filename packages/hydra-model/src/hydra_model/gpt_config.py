"""GPTConfig: the dense baseline's settings, its size presets and their validation.

The presets carry HYDRA's preset names and are sized so that each lands within ±10% of the HYDRA
preset's parameter count at vocab 32000 (tests/hydra_model/test_gpt.py checks it against
``create_ccgqa_mod_mor_model(size).num_parameters()``): the comparison is between models of the
same size. Widths follow the usual dense-decoder recipe: head size 64, GQA with 2–4 query heads
per key/value head, SwiGLU hidden ≈ 2.5–2.75 · dim (8/3 · dim at 100M) rounded to a multiple of 64.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, fields
from typing import Any

ATTENTIONS = ("gqa", "ccgqa")
_INT_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "mlp_hidden",
    "max_seq_len",
)

#: Size presets (parameters at vocab 32000 in the comment; HYDRA's preset in brackets).
GPT_PRESETS: dict[str, dict[str, Any]] = {
    # 10.2M [10.0M]: a CPU-sized model, mostly embedding like HYDRA's tiny
    "tiny": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=384, max_seq_len=1024),
    # 34.1M [33.0M]
    "debug": dict(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, mlp_hidden=1408, max_seq_len=2048),
    # 100.1M [101.7M]: the classic 12 × 768 with Llama's 8/3 · dim SwiGLU
    "100M": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, mlp_hidden=2048, max_seq_len=2048),
    # 200.6M [203.3M]
    "250M": dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, mlp_hidden=2560, max_seq_len=2048),
    # 433.0M [437.3M]
    "500M": dict(dim=1536, n_layers=16, n_heads=24, n_kv_heads=8, mlp_hidden=3840, max_seq_len=2048),
    # 967.4M [974.2M]
    "1B": dict(dim=2048, n_layers=20, n_heads=32, n_kv_heads=8, mlp_hidden=5632, max_seq_len=2048),
}


@dataclass
class GPTConfig:
    """Every setting of :class:`hydra_model.gpt.GPTModel`."""

    vocab_size: int = 32000
    dim: int = 512
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 64
    #: SwiGLU hidden width (a multiple of 64, matmul-friendly)
    mlp_hidden: int = 1408
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    init_std: float = 0.02
    #: "gqa": standard grouped-query attention (Llama's); "ccgqa": HYDRA's compressed convolutional
    #: attention with the same head counts and sizes (the race's ``gpt-ccgqa`` ablation)
    attention: str = "gqa"
    #: fused LM head + cross-entropy (hydra_kernels.linear_cross_entropy): no [N, V] logits
    use_chunked_ce: bool = False

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:  # numpy integers (e.g. a vocabulary size read from data) → int
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        self.validate()

    # --- derived widths --------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates every channel of a head (Llama's convention)."""
        return self.head_dim

    @property
    def effective_depth(self) -> int:
        """Layers a token passes through (what the residual-projection init scales by)."""
        return self.n_layers

    # --- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what would fix it."""

        def bad(msg: str) -> None:
            raise ValueError(f"GPTConfig: {msg}")

        for name in (n for n in _INT_FIELDS if n != "mlp_hidden"):  # mlp_hidden: checked below
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(f"{name}={value!r} must be a positive integer")
        if self.head_dim % 2:
            bad(f"head_dim={self.head_dim} must be even (RoPE rotates channel pairs); use e.g. 64")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            bad(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(each key/value head serves a whole group of query heads)"
            )
        if isinstance(self.mlp_hidden, bool) or not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 64:
            bad(f"mlp_hidden={self.mlp_hidden!r} must be an integer ≥ 64")
        if self.mlp_hidden % 64:
            up = -(-self.mlp_hidden // 64) * 64
            bad(f"mlp_hidden={self.mlp_hidden} must be a multiple of 64; use {up}")
        if self.attention not in ATTENTIONS:
            bad(f"attention={self.attention!r}; expected one of {', '.join(ATTENTIONS)}")
        for name in ("norm_eps", "rope_base", "init_std"):
            if not float(getattr(self, name)) > 0:
                bad(f"{name}={getattr(self, name)} must be positive")

    # --- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError naming them."""
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown GPTConfig field(s) {unknown}; valid fields: {', '.join(cls.field_names())}"
            )
        return cls(**d)

    def diff(self, other: GPTConfig) -> list[str]:
        """Fields that differ, as ``"field: mine != theirs"`` (empty when the configs agree)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} != {b.get(k)!r}" for k in a if a[k] != b.get(k)]

    def replace(self, **changes: Any) -> GPTConfig:
        return GPTConfig.from_dict({**self.to_dict(), **changes})


def gpt_config(model_size: str = "debug", **overrides: Any) -> GPTConfig:
    """The preset ``model_size`` (tiny, debug, 100M, 250M, 500M, 1B) with ``overrides`` applied."""
    if model_size not in GPT_PRESETS:
        raise ValueError(f"unknown model_size {model_size!r}; presets: {', '.join(GPT_PRESETS)}")
    return GPTConfig.from_dict({**GPT_PRESETS[model_size], **overrides})
