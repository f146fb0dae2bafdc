"""A checksum over every tensor a checkpoint holds, so that flipped bytes are found on load.

``torch.load`` reads a tensor whose bytes were changed on disk without complaint (the zip records
carry no checksum that torch checks), and a bit flip inside the weights then shows up only as NaN
losses many steps later. :func:`payload_digest` hashes each tensor's raw bytes together with its
key path, dtype and shape (SHA-256); the saver stores it under ``"checksum"`` and the loader
recomputes and compares it. Checkpoints written before this existed carry no checksum: they load
with a note (there is nothing to check them against). It lives in hydra_model because both
hydra-train's saver and ``hydra-model import-hf`` write checkpoints, and both hydra-train's resume
and hydra_model's loader (``persistence.verify_checksum``: generate, export-hf) verify them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

CHECKSUM_KEY = "checksum"


def _walk(obj: Any, path: str, h: hashlib._Hash) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{path}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            if path == "" and k == CHECKSUM_KEY:
                continue
            _walk(obj[k], f"{path}/{k}", h)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", h)


def payload_digest(payload: dict[str, Any]) -> str:
    """``sha256:<hex>`` over every tensor in ``payload`` (the checksum entry itself excluded)."""
    h = hashlib.sha256()
    _walk(payload, "", h)
    return f"sha256:{h.hexdigest()}"
