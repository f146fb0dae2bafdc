"""What ``hydra-model generate`` adds around :meth:`generate`: the tokenizer's end-of-text id, the
timing of the generation and the cut at end-of-text.

The end-of-text token is looked up by name in the tokenizer (``<|endoftext|>`` first: the token
hydra-train's tokenizers append after every document); generation stops when the model emits it,
and it is not part of the printed text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The tokenizer file hydra-train copies beside its checkpoints (and import-hf beside its own).
TOKENIZER_FILE = "tokenizer.json"

#: Names of end-of-text tokens, in order of preference.
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


def find_tokenizer(checkpoint: Path, explicit: Path | None = None) -> Path:
    """``explicit`` when given (it must exist), else the ``tokenizer.json`` beside ``checkpoint``
    (inside it when it is a save_pretrained folder); FileNotFoundError naming where it looked."""
    if explicit is not None:
        if not explicit.is_file():
            raise FileNotFoundError(f"--tokenizer {explicit} does not exist")
        return explicit
    beside = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / TOKENIZER_FILE
    if beside.is_file():
        return beside
    raise FileNotFoundError(f"no tokenizer: pass --tokenizer PATH/tokenizer.json (none found at {beside})")


def end_of_text_id(tokenizer: Any) -> int | None:
    """The id of the tokenizer's end-of-text token, or None when it has none of the known names."""
    for name in END_OF_TEXT_NAMES:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


@dataclass
class Generated:
    ids: list[int]  # the new tokens, end-of-text excluded
    stopped_at_eos: bool
    produced: int  # tokens the model produced (the end-of-text token included)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.produced / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        why = "stopped at end-of-text" if self.stopped_at_eos else "reached --max_new_tokens"
        return f"{self.produced} tokens in {self.seconds:.2f} s ({self.tokens_per_s:,.1f} tokens/s), {why}"


def timed_generate(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> Generated:
    """Continue one prompt; the wall time covers the whole generation (prefill included)."""
    x = torch.tensor([prompt_ids], device=device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        x, max_new_tokens, temperature, top_k, top_p, eos_token_id=eos_id, generator=generator
    )
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    new = out[0, len(prompt_ids) :].tolist()
    if eos_id is not None and eos_id in new:
        cut = new.index(eos_id)
        return Generated(new[:cut], True, cut + 1, seconds)
    return Generated(new, False, len(new), seconds)
