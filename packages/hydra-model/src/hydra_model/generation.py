"""Sampling loop for :meth:`CCGQAMoDMoRModel.generate`: one prefill pass, then one token a step."""

from __future__ import annotations

import contextlib
import math
import operator
from typing import TYPE_CHECKING

import torch

from hydra_model import decoder_hold
from hydra_model.cache import ModelCache
from hydra_model.decode_graphs import DecodeReport, StagedDecoder, resolve_mode

if TYPE_CHECKING:
    from hydra_model.model import CCGQAMoDMoRModel


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token [B] from logits [B, V]: argmax at temperature 0, else top-k / nucleus sampling."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.float()
    # shifted so that the largest is 0 before dividing: a tiny temperature then gives -inf for
    # the others, not inf − inf = NaN in the softmax (the distribution is the same)
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:  # 1 keeps every token (fp32 cumulative sums would not)
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token when the tokens before it already cover top_p (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise a ValueError naming a sampling setting no sampler takes (checked before a prefill)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be a finite number ≥ 0 (0 = greedy)")
    if top_k is not None and as_int(top_k, "top_k") < 1:
        raise ValueError(f"top_k={top_k} must be ≥ 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


def check_prompt(model: CCGQAMoDMoRModel, input_ids: torch.Tensor) -> None:
    """Raise a ValueError naming what is wrong with a prompt before anything runs: its shape,
    dtype, device (the model's), and token ids outside the vocabulary (one host read: on a GPU
    such an id would otherwise end in a device-side assert that poisons the CUDA context)."""
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, S] with B ≥ 1 and S ≥ 1, got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"input_ids must hold token ids (torch.long), got {input_ids.dtype}")
    on = model.embed.weight.device
    if input_ids.device != on:
        raise ValueError(f"input_ids are on {input_ids.device} and the model on {on}: move one to the other")
    low, high = (int(v) for v in torch.aminmax(input_ids))
    vocab = model.config.vocab_size
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids hold token ids {low}..{high}; the model's vocabulary is 0..{vocab - 1}")


def as_int(value: object, name: str) -> int:
    """``value`` as a Python int (numpy and 0-d tensor integers are taken), else a TypeError naming
    ``name``: a float count failed deep inside a tensor allocation, after the prefill."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def check_eos(model: CCGQAMoDMoRModel, eos_token_id: int | None) -> int | None:
    """``eos_token_id`` as an int, or a ValueError when the model cannot produce it: a generation
    asked to stop there would silently run to ``max_new_tokens``."""
    if eos_token_id is None:
        return None
    eos, vocab = as_int(eos_token_id, "eos_token_id"), model.config.vocab_size
    if not 0 <= eos < vocab:
        raise ValueError(
            f"eos_token_id={eos} is outside the model's vocabulary 0..{vocab - 1}: the model can "
            "never produce it (pass the end-of-text id of the tokenizer the model was trained with, "
            "or None)"
        )
    return eos


@torch.no_grad()
def generate(
    model: CCGQAMoDMoRModel,
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
    """Prompt [B, S] (equal lengths, no padding) → [B, S + generated]. Stops early only when every
    sequence has produced ``eos_token_id``; finished sequences are padded with it. ``decode``
    picks how the steps after the prompt run (decode_graphs.py); the model's
    ``last_decode_report`` records what ran. ``keep_decoder``: keep the staged or graphed decoder
    (its graphs and cache) for the next call with the same batch size and S + max_new_tokens in
    the same bucket of 64 positions, which then skips the warm-up and capture (decoder_hold.py)."""
    check_prompt(model, input_ids)
    check_sampling(temperature, top_k, top_p)
    eos_token_id = check_eos(model, eos_token_id)
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be ≥ 0")
    mode = resolve_mode(decode, input_ids.device)
    was_training = model.training
    # model.eval() walks every module and sets an attribute on each (about 0.4 ms a call for
    # HYDRA's 100M preset, on the host at batch 1): skipped when no module is training. After,
    # each module's own flag is put back (a frozen submodule of a training model stays in eval)
    modes = [(m, m.training) for m in model.modules()]
    cleanup = contextlib.ExitStack()
    if any(training for _, training in modes):
        model.eval()
        cleanup.callback(_restore_modes, modes)
    if input_ids.is_cuda:  # its device current: graphs capture on that device's stream (cuda_graph.py)
        cleanup.enter_context(torch.cuda.device(input_ids.device))
    with cleanup:
        pieces = [input_ids]
        if max_new_tokens == 0:  # the report says so: it described the previous call
            model.last_decode_report = DecodeReport(
                mode="none", requested=decode, reason="max_new_tokens=0: nothing was decoded", prefill="none"
            )
            return input_ids
        batch, device = input_ids.shape[0], input_ids.device
        keep = keep_decoder and mode != "eager" and decoder_hold.keepable(was_training, device)
        total = input_ids.shape[1] + max_new_tokens
        # a kept decoder's cache is rounded up: the next prompt of another length can reuse it
        capacity = decoder_hold.cache_capacity(total, model.config.max_seq_len) if keep else total
        if model.rope is not None:
            model.rope.ensure(capacity)
        request = decoder_hold.request_of(model, mode, batch, capacity, device)
        held, not_reused = None, None
        if keep:
            held, not_reused = decoder_hold.take(model, request)
        else:
            decoder_hold.release(model)
        if held is not None:
            cache = held.decoder.cache
            logits, in_place = held.prefill(model, input_ids)  # restarts and refills the cache
            if not in_place:  # a valid prefill, in new tensors: a new decoder on them
                held, not_reused = None, "the prefill replaced a cache tensor a captured step reads"
        else:
            cache = ModelCache(capacity=capacity)
            logits = model(input_ids, cache=cache).logits[:, -1]
        decoder = None
        if mode == "eager":
            model.last_decode_report = DecodeReport(mode="eager", requested=decode)
        elif held is not None:
            decoder = held.decoder
            decoder.reuse(decode, prefill=held.last_prefill)
        else:
            decoder = StagedDecoder(model, cache, batch, device, mode)
            decoder.report.requested = decode
        if decoder is not None:
            decoder.report.not_reused = not_reused
            model.last_decode_report = decoder.report
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        pending = None
        try:
            for step in range(max_new_tokens):
                nxt = sample_next(logits, temperature, top_k, top_p, generator)
                if eos_token_id is not None:
                    nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                    finished |= nxt == eos_token_id
                pieces.append(nxt.unsqueeze(1))
                if step == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
                    break
                if decoder is None:
                    logits = model(nxt.unsqueeze(1), cache=cache).logits[:, -1]
                    model.last_decode_report.steps += 1
                else:
                    logits = decoder.step(nxt)
            if decoder is not None and keep:  # its fingerprint runs behind the queued steps
                pending = decoder_hold.start_keep(model, held, decoder, request, input_ids.shape[1])
        finally:
            if decoder is not None:  # the report counts the steps that ran, a failed one too
                decoder.finish()
        if pending is not None:
            pending.finish()
        return torch.cat(pieces, dim=1)


def _restore_modes(modes: list) -> None:
    for module, training in modes:
        module.training = training
