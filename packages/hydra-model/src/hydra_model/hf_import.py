"""``hydra-model import-hf``: a Hugging Face Llama folder as a dense-GPT checkpoint file.

The file has hydra-train's checkpoint layout (``format`` "hydra-train-checkpoint", ``step`` 0,
``model``, ``config`` {"model", "arch": "gpt"}, the tensors' checksum), so ``hydra-model
generate --checkpoint`` and hydra-train's checkpoint loader accept it. It carries no optimizer,
schedule or data position: it is a model to start from, not a run to continue. Named
``hydra_gpt-<size>_step0.pt`` in a ``--checkpoint_dir``, ``hydra-train run --arch gpt --resume``
(with ``--model_override`` flags giving the same config) trains on from its weights at step 0.
The folder's ``tokenizer.json``, if any, is copied beside the file, where ``generate`` looks.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from hydra_model.checkpoint_digest import CHECKSUM_KEY, payload_digest
from hydra_model.error_text import writing
from hydra_model.hf_llama import (
    NotALlamaError,
    gpt_config_from_llama,
    llama_to_gpt_state,
    read_llama_config,
    read_safetensors_folder,
)

#: hydra-train's checkpoint format name and version (hydra_train/checkpoint.py)
CHECKPOINT_FORMAT = "hydra-train-checkpoint"
CHECKPOINT_VERSION = 1


def import_hf(hf_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Convert the Llama in ``hf_dir`` into a GPT checkpoint at ``out`` (a ``.pt`` file).
    Raises NotALlamaError / FileNotFoundError naming what does not fit."""
    from hydra_model.gpt import GPTModel

    folder, out = Path(hf_dir), Path(out)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder (expected a Hugging Face model folder)")
    if out.suffix != ".pt":
        raise NotALlamaError(f"{out}: the checkpoint file name must end in .pt")
    hf = read_llama_config(folder)
    cfg = gpt_config_from_llama(hf, folder)
    state = llama_to_gpt_state(
        read_safetensors_folder(folder), cfg, folder, bool(hf.get("tie_word_embeddings"))
    )
    with torch.device("meta"):
        model = GPTModel(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise NotALlamaError(
                f"{folder}: {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}"
            )
    tokenizer = folder / "tokenizer.json"
    beside = out.parent / "tokenizer.json"
    if tokenizer.is_file() and beside.is_file() and beside.read_bytes() != tokenizer.read_bytes():
        raise NotALlamaError(
            f"{beside} exists and differs from {tokenizer}; write the checkpoint into another folder"
        )
    # fp32 weights: what hydra-train trains and resumes (a bf16 Llama is widened exactly)
    payload: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "step": 0,
        "time": time.time(),
        "run_id": None,
        "imported_from": str(folder.resolve()),
        "model": {k: state[k].to(torch.float32).contiguous() for k in expected},
        "config": {"model": cfg.to_dict(), "arch": "gpt"},
    }
    payload[CHECKSUM_KEY] = payload_digest(payload)
    # one line naming OUT, not an OSError's traceback (the tokenizer's own read errors stay its own)
    with writing(out, "the checkpoint", reading=(tokenizer,)):
        copied = _write_checkpoint(payload, out, tokenizer if tokenizer.is_file() else None)
    return {
        "checkpoint": str(out),
        "arch": "gpt",
        "config": cfg.to_dict(),
        "parameters": sum(t.numel() for t in payload["model"].values()),
        "tokenizer": copied,
    }


def _write_checkpoint(payload: dict[str, Any], out: Path, tokenizer: Path | None) -> str | None:
    """Write ``payload`` to ``out`` through a temporary file renamed over it once complete, and
    copy ``tokenizer`` beside it when none is there: (the tokenizer beside it, or None)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".pt.tmp")
    try:
        # torch.save given a path writes through its own C++ writer, whose failures are
        # RuntimeErrors ("Parent directory ... does not exist", "unexpected pos" on a full disk);
        # through an unbuffered Python file each write's OSError reaches the caller as it is
        with open(tmp, "wb", buffering=0) as f:
            torch.save(payload, f)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed save leaves no half-written file beside
    if tokenizer is None:
        return None
    beside = out.parent / "tokenizer.json"
    if not beside.is_file():
        shutil.copyfile(tokenizer, beside)
    return str(beside)


__all__ = ["NotALlamaError", "import_hf"]
