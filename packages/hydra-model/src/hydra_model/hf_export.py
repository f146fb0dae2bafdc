"""``hydra-model export-hf``: a checkpoint of either architecture as a Hugging Face model folder.

The folder holds ``config.json`` (with a ``model_type``), ``model.safetensors``,
``generation_config.json`` and the tokenizer the model was trained with (``tokenizer.json``
plus ``tokenizer_config.json`` and ``special_tokens_map.json``, so ``AutoTokenizer`` reads it):

* the dense GPT as a native ``LlamaForCausalLM`` (model_type "llama", no remote code;
  hf_llama.py);
* HYDRA as ``HydraForCausalLM`` with its modeling code shipped in the folder (model_type
  "hydra_ccgqa", ``trust_remote_code=True``; hf_hydra.py).

No transformers import here: the files are written directly.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hydra_model.architectures import arch_of
from hydra_model.error_text import shortened, writing
from hydra_model.persistence import check_finite_weights, load_model

#: --dtype choices: the dtype the weights are written in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_FILE = "model.safetensors"
#: every file an export may write: those this export does not write are removed from OUT, so an
#: earlier export into the same folder leaves nothing behind (other files are not touched)
EXPORT_FILES = (
    "config.json",
    WEIGHTS_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "configuration_hydra.py",
    "modeling_hydra.py",
)


class ExportError(ValueError):
    """The checkpoint or the tokenizer cannot be exported as asked."""


@dataclass
class Exported:
    """What :func:`export_hf` wrote."""

    folder: Path
    arch: str
    model_type: str
    parameters: int
    files: list[str] = field(default_factory=list)
    eos_token_id: int | None = None
    tokenizer: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "arch": self.arch,
            "model_type": self.model_type,
            "parameters": self.parameters,
            "files": self.files,
            "eos_token_id": self.eos_token_id,
            "tokenizer": self.tokenizer,
            "trust_remote_code": self.model_type != "llama",
        }


def tokenizer_special_ids(tokenizer_path: Path | None) -> tuple[dict[str, int | None], str | None]:
    """({"eos_token_id", "bos_token_id", "pad_token_id"}, the end-of-text token's text) of a
    tokenizers ``tokenizer.json``; None ids without one. Generation stops at end-of-text, and it
    serves as padding (the models were trained without a pad token)."""
    if tokenizer_path is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, None
    from tokenizers import Tokenizer

    from hydra_model.text_generation import end_of_text_id

    try:
        tok = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        reason = shortened(str(exc), 120)
        raise ExportError(f"{tokenizer_path} is not a readable tokenizer.json ({reason})") from None
    eos = end_of_text_id(tok)
    ids = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos}
    return ids, (tok.id_to_token(eos) if eos is not None else None)


def write_tokenizer(tokenizer_path: Path, out: Path, eos_text: str | None, max_len: int) -> list[str]:
    """tokenizer.json as it is, and the two small files ``AutoTokenizer`` needs beside it."""
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")  # ``out``: export_hf's fresh staging folder
    special = {"eos_token": eos_text, "pad_token": eos_text} if eos_text is not None else {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


#: how safetensors words an OSError: "I/O error: No space left on device (os error 28) at path ..."
_SAFETENSORS_IO_ERROR = re.compile(r"I/O error: (?P<reason>.+?) \(os error (?P<errno>\d+)\)")


def _save_weights(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()
    }
    try:
        # transformers refuses safetensors files whose metadata does not say "pt"
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        # its I/O errors (a full disk) are no OSError: made one, so that they are said as such
        io = _SAFETENSORS_IO_ERROR.search(str(exc))
        if io is None:
            raise
        raise OSError(int(io["errno"]), io["reason"], str(path)) from exc


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    allow_pickle: bool = False,
) -> Exported:
    """Write the model of ``checkpoint`` (a save_pretrained folder or a hydra-train .pt) as a
    Hugging Face folder ``out`` (created; an earlier export there is replaced once the new one is
    complete, other files are left alone). ``tokenizer``:
    a tokenizer.json to ship (None: none is written). Raises ExportError (or the loaders'
    ValueError / FileNotFoundError) naming what is wrong, and OutputNotWritable (an OSError,
    error_text.py) naming ``out`` when it cannot be written."""
    from hydra_model.hf_llama import check_exportable_gpt

    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and Path(checkpoint).is_dir() and out.samefile(checkpoint):
        # the export's config.json and model.safetensors would overwrite the checkpoint's own
        raise ExportError(f"{out} is the checkpoint folder itself; export into another folder")
    model = load_model(checkpoint, map_location="cpu", allow_pickle=allow_pickle)
    check_finite_weights(model, checkpoint)
    model.eval()
    arch, cfg = arch_of(model), model.config
    if arch == "gpt":
        try:
            check_exportable_gpt(cfg)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    tok_path = Path(tokenizer) if tokenizer is not None else None
    special, eos_text = tokenizer_special_ids(tok_path)
    # one line naming OUT, not an OSError's traceback (the tokenizer's own read errors stay its own)
    with writing(out, "the export folder", reading=(tok_path,)):
        files, model_type = _write_folder(model, arch, special, dtype, tok_path, eos_text, out)
    return Exported(
        folder=out,
        arch=arch,
        model_type=model_type,
        parameters=model.num_parameters(),
        files=sorted(files),
        eos_token_id=special["eos_token_id"],
        tokenizer=str(tok_path) if tok_path is not None else None,
    )


def _write_folder(
    model: torch.nn.Module,
    arch: str,
    special: dict[str, int | None],
    dtype: str,
    tok_path: Path | None,
    eos_text: str | None,
    out: Path,
) -> tuple[list[str], str]:
    """Write the export's files into ``out``: (their names, the model_type)."""
    from hydra_model.hf_hydra import MODEL_TYPE, copy_remote_code, hydra_export_state, hydra_hf_config
    from hydra_model.hf_llama import gpt_to_llama_state, llama_config

    cfg = model.config
    out.mkdir(parents=True, exist_ok=True)
    # every file is written into a staging folder and moved in once all are complete: an export
    # that fails part-way (full disk, killed) leaves an earlier one whole. The staging folder is
    # inside OUT, not beside it: OUT's parent need not be writable, and a rename within one
    # folder cannot cross file systems
    stage = out / ".hydra-export-tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        files: list[str] = []
        state = model.state_dict()
        if arch == "gpt":
            config, model_type = llama_config(cfg, special, dtype), "llama"
            _save_weights(gpt_to_llama_state(state, cfg), stage / WEIGHTS_FILE, DTYPES[dtype])
        else:
            config, model_type = hydra_hf_config(model, special, dtype), MODEL_TYPE
            _save_weights(hydra_export_state(model), stage / WEIGHTS_FILE, DTYPES[dtype])
            files += [p.name for p in copy_remote_code(stage)]
        _write_json(stage / "config.json", config)
        generation = {**special, "do_sample": False}
        if arch != "gpt":
            generation["use_cache"] = False  # the shipped code reruns the prefix: no cache to use
        _write_json(stage / "generation_config.json", generation)
        files += ["config.json", WEIGHTS_FILE, "generation_config.json"]
        if tok_path is not None:
            files += write_tokenizer(tok_path, stage, eos_text, cfg.max_seq_len)
        for name in files:
            (stage / name).replace(out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for stale in sorted(set(EXPORT_FILES) - set(files)):  # an earlier export's, e.g. remote code
        (out / stale).unlink(missing_ok=True)
    return files, model_type
