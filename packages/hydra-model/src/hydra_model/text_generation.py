"""What ``hydra-model generate`` adds around :meth:`generate`: the tokenizer's end-of-text id, the
timing of the generation and the cut at end-of-text.

The end-of-text token is looked up by name in the tokenizer (``<|endoftext|>`` first: the token
hydra-train's tokenizers append after every document); generation stops when the model emits it,
and it is not part of the printed text. An end-of-text id the model cannot produce (a tokenizer
larger than its vocabulary) and generated ids the tokenizer has no token for (a model vocabulary
larger than the tokenizer's) are noted on stderr, not silently dropped. Two things are warned
about before the generation rather than refused: a prompt plus the tokens to generate longer than
the model's ``max_seq_len``, and a ``--tokenizer`` smaller than its vocabulary (the functions say why).
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
        if explicit.is_dir():  # it exists: "does not exist" would mislead
            raise FileNotFoundError(f"--tokenizer {explicit} is a folder: pass the tokenizer.json file in it")
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


def resolve_device(spec: str) -> str:
    """``--device``: auto (CUDA when a GPU is visible, else the CPU), cpu, cuda or cuda:N. A
    ValueError names a spec that is no such device (a usage error), a RuntimeError a CUDA device
    this machine does not have: loading the checkpoint there failed with a message about the
    checkpoint ("unreadable, probably truncated or corrupt", or pinned memory)."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise RuntimeError(f"--device {spec}: no CUDA GPU is visible here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise RuntimeError(f"--device {spec}: {count} CUDA GPU(s) visible, cuda:0..cuda:{count - 1}")
    return "cpu" if device.type == "cpu" else str(device)  # cpu:0 is the CPU (threads, JSON)


def usable_end_of_text(tokenizer: Any, vocab_size: int) -> tuple[int | None, str | None]:
    """(the tokenizer's end-of-text id, None), or (None, a note saying why it is not used) when the
    model cannot produce it (a tokenizer larger than the model's vocabulary): generate refuses such
    an id, and it would never have stopped the generation."""
    eos = end_of_text_id(tokenizer)
    if eos is None or eos < vocab_size:
        return eos, None
    return None, (
        f"the tokenizer's end-of-text id {eos} is outside the model's vocabulary 0..{vocab_size - 1}: "
        "generation runs to --max_new_tokens (is it the tokenizer the model was trained with?)"
    )


def prompt_ids_error(ids: list[int], vocab_size: int, tokenizer_path: Path, explicit: bool) -> str | None:
    """The error when the prompt encodes to an id the model has no embedding for, else None: the
    tokenizer is not the one the model was trained with (a larger vocabulary), so say which file
    was used and how to pass the right one."""
    high = max(ids)
    if high < vocab_size:
        return None
    used = f"--tokenizer {tokenizer_path}" if explicit else f"the checkpoint's tokenizer {tokenizer_path}"
    return (
        f"{used} encodes the prompt to id {high}, outside the model's vocabulary 0..{vocab_size - 1}: "
        "it is not the tokenizer the model was trained with; pass that one with --tokenizer PATH"
    )


def past_max_seq_len_warning(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> str | None:
    """A warning when the prompt and the tokens to generate exceed the model's ``max_seq_len``, else
    None. Not refused: the rotary table grows with the same formula (RotaryEmbedding.ensure), so
    the positions past it are computed exactly; but the model was never trained on them, and the
    text there usually degrades (the more, the further past)."""
    total = prompt_len + max_new_tokens
    if total <= max_seq_len:
        return None
    room = max_seq_len - prompt_len
    todo = (
        f"--max-new-tokens {room} or fewer stays within it"
        if room > 0
        else f"shorten the prompt below {max_seq_len} tokens to stay within it"
    )
    return (
        f"the prompt ({prompt_len} tokens) and --max-new-tokens {max_new_tokens} make {total} tokens, "
        f"past the model's max_seq_len {max_seq_len} (it never trained on positions past it): the "
        f"text there usually degrades; {todo}"
    )


def small_tokenizer_warning(tokenizer: Any, vocab_size: int, where: Path) -> str | None:
    """A warning when the tokenizer ``--tokenizer`` names has fewer tokens than the model's
    vocabulary, else None: ids past it decode to nothing, and ``decode`` leaves them out of the
    text without a word. Not refused: a vocabulary may be padded past its tokenizer (hydra-train's
    --vocab_size, a Llama's rounded embedding), and such a model never learns to emit those ids;
    a tokenizer much smaller than the vocabulary is more likely another model's."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size >= vocab_size:
        return None
    return (
        f"--tokenizer {where} has {size} tokens, the model's vocabulary {vocab_size}: ids "
        f"{size}..{vocab_size - 1} it may generate have no text and are left out; is it the "
        "tokenizer the model was trained with? (pass that one with --tokenizer)"
    )


def ignored_sampling_note(temperature: float, top_k: int | None, top_p: float | None) -> str | None:
    """A note when --top-k or --top-p are given without a temperature: greedy decoding (the
    default, 0) ignores them, and every --seed gives the same text."""
    given = [name for name, value in (("--top-k", top_k), ("--top-p", top_p)) if value is not None]
    if temperature > 0 or not given:
        return None
    verb = "applies" if len(given) == 1 else "apply"
    return f"{' and '.join(given)} {verb} only when sampling (--temperature > 0): this generation is greedy"


def undecodable_note(tokenizer: Any, ids: list[int], where: Path) -> str | None:
    """A note on the ``ids`` the tokenizer has no token for (a model vocabulary larger than the
    tokenizer's), which its ``decode`` leaves out of the text without a word; None if none."""
    lost = {i for i in ids if tokenizer.id_to_token(i) is None}
    if not lost:
        return None
    shown = ", ".join(map(str, sorted(lost)[:8])) + (", ..." if len(lost) > 8 else "")
    n = sum(i in lost for i in ids)
    return f"{n} of the {len(ids)} generated tokens (ids {shown}) have no entry in {where}: not in the text"


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
