"""Routing statistics to plain Python (syncs with the device: call outside the hot path)."""

from __future__ import annotations

from typing import Any

import torch


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def routing_stats_to_python(stats: dict[str, Any]) -> dict[str, Any]:
    """``model.routing_stats()`` with every tensor turned into a float or a list of floats."""
    return _to_python(stats)
