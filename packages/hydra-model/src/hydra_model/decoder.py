"""What every decoder HYDRA builds offers beyond its forward: FLOP accounting, generation and
persistence, written once for the routed model (model.py) and the dense GPT (gpt.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hydra_kernels import linear_cross_entropy

#: targets with this value are left out of the loss (padding, prompt tokens)
IGNORE_INDEX = -100


def check_return_logits(targets: torch.Tensor | None, return_logits: bool) -> None:
    """``return_logits=False`` asks a forward with targets for its losses alone. A training step
    that only backpropagates the loss should ask so under ``torch.compile``: a compiled forward's
    outputs that need gradients each get one in its backward, and the [B, S, V] logits that no
    loss reads get a zero gradient the size of the logits, filled and added (and, with CUDA
    graphs, copied into the graph: 1.3 ms of HYDRA's 28.2 ms race step at the 100M preset on an
    H100, 1.2 of the GPT's 35.6, packages/hydra-diag/BENCHMARKS.md). Without targets a forward
    has nothing else to return."""
    if not return_logits and targets is None:
        raise ValueError(
            "return_logits=False returns only the losses, which need targets; pass targets or "
            "keep return_logits=True"
        )


class DecoderMixin:
    """``flops_per_token``, ``generate``, ``save_pretrained`` and ``from_pretrained`` for a module
    with a ``config`` that footprint.py, generation.py and persistence.py understand."""

    config: Any
    embed: torch.nn.Embedding

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (the tied LM head counts once, with the embedding)."""
        seen = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in seen.values())
        return total - self.embed.weight.numel() if exclude_embeddings else total

    def head_and_loss(
        self, h: torch.Tensor, targets: torch.Tensor, return_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Final hidden states h [B, S, E] → (logits [B, S, V] or None, mean cross-entropy) through
        the tied LM head; ``config.use_chunked_ce`` fuses head and loss
        (``hydra_kernels.linear_cross_entropy``: no [tokens, vocab] logits); ``return_logits``
        False: None for the logits, computed for the loss only (:func:`check_return_logits`)."""
        cfg = self.config
        if cfg.use_chunked_ce:
            hid, weight = h.reshape(-1, cfg.dim), self.embed.weight
            if torch.is_autocast_enabled(h.device.type):  # custom op: cast as autocast would
                dt = torch.get_autocast_dtype(h.device.type)
                hid, weight = hid.to(dt), weight.to(dt)
            return None, linear_cross_entropy(hid, weight, targets.reshape(-1), ignore_index=IGNORE_INDEX)
        logits = F.linear(h, self.embed.weight)
        flat = targets.reshape(-1)
        # torch's mean, divided here so that a batch with every target ignored has loss 0 and
        # zero gradients, as the chunked path's (torch's mean of no tokens is NaN); the same
        # sum and division as reduction="mean" otherwise, so the same bits
        ce = F.cross_entropy(
            logits.float().reshape(-1, cfg.vocab_size), flat, ignore_index=IGNORE_INDEX, reduction="sum"
        ) / (flat != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)
        return (logits if return_logits else None), ce

    def flops_per_token(self, seq_len: int, executed: bool = True) -> float:
        """Training FLOPs (forward + backward ≈ 3× forward) per token at ``seq_len``, attention
        included; ``executed`` counts only what routing runs (the dense GPT routes nothing),
        otherwise the dense equivalent."""
        from hydra_model.footprint import flops_per_token

        return flops_per_token(self.config, seq_len, executed=executed)

    def decode_stages(self, cache, tokens: torch.Tensor, logits: torch.Tensor, flags=None) -> list:
        """One decode step as stages for decode_graphs.py: by default the whole forward, one stage
        (a model with routed blocks splits it so that a graphed step can skip them). ``tokens``
        [B, 1] and ``logits`` [B, V] are the step's persistent input and output buffers; ``flags``
        (a bool vector for the routed blocks' decision flags) is unused here."""
        from hydra_model.decode_graphs import DecodeStage

        # the step's position tensor made now, not by its first forward: a step captured before
        # it ever ran (decode_graphs.py) must find everything it reads
        cache.positions(tokens.shape[0], tokens.device)

        def step() -> None:
            logits.copy_(self(tokens, cache=cache).logits[:, -1])

        return [DecodeStage(step)]

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        decode: str = "auto",
        keep_decoder: bool = True,
    ) -> torch.Tensor:
        """Incremental decoding with the model's cache (keys/values, and CCGQA's conv and
        value-shift state) → [B, S + new]. The B prompts have one length S: there is no padding
        or attention mask (a pad token would be read as text), so prompts of other lengths take
        a call each (a kept decoder serves them). With ``eos_token_id`` a sequence that produced
        it emits it from then on, and the call stops once every sequence has. ``decode``: auto
        (CUDA graphs on CUDA, else eager), eager, staged or graphs (decode_graphs.py);
        ``self.last_decode_report`` says what ran.
        ``keep_decoder``: keep a staged or graphed decoder for the next call of the same batch
        size and a total length in the same 64-position bucket, which then replays its graphs
        without a warm-up or capture (decoder_hold.py); :meth:`release_decoder` frees it."""
        from hydra_model.generation import generate

        return generate(
            self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator, decode,
            keep_decoder,
        )  # fmt: skip

    def release_decoder(self) -> bool:
        """Free the decoder kept by the last :meth:`generate` (its CUDA graphs and cache); True if
        one was kept."""
        from hydra_model.decoder_hold import release

        return release(self)

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
