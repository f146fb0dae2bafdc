"""Configuration of a HYDRA model exported for Hugging Face transformers (remote code).

Shipped into every ``hydra-model export-hf`` folder of a HYDRA model and loaded by
``AutoConfig.from_pretrained(folder, trust_remote_code=True)``. It imports only transformers:
the folder must load where HYDRA is not installed.

``layout`` says, block by block, what the exporting ``hydra_model`` instance computes (widths,
which routers exist, how each routing point decides at inference, its fixed-point capacity);
``modeling_hydra.py`` follows it and reads nothing else. ``hydra`` is the whole ``HydraConfig``
of the checkpoint, kept for provenance (``hydra_model`` reads it back; this code does not).
"""

from transformers import PretrainedConfig


class HydraHFConfig(PretrainedConfig):
    model_type = "hydra_ccgqa"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        num_hidden_layers: int = 2,
        max_position_embeddings: int = 2048,
        layout: dict | None = None,
        hydra: dict | None = None,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.layout = layout or {}
        self.hydra = hydra or {}
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("use_cache", False)  # no incremental cache: each step reruns the prefix
        super().__init__(**kwargs)
