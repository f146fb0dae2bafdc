"""``hydra-train run --dry_run``: the configuration a run would use and the optimizations it would
pretest, resolved for the requested device without loading data or building the model. ``--device
cuda`` works on a machine without CUDA (an assumed 80 GiB bf16 GPU, said so in the output), so the
GPU defaults can be checked anywhere."""

from __future__ import annotations

from typing import Any

import torch

from hydra_train.config import DeviceInfo, TrainConfig, compile_reason, resolve_config

#: what a dry run assumes about a CUDA device it cannot see (an H100-class card)
ASSUMED_CUDA = DeviceInfo("cuda", 80.0, True)


def dry_run(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved configuration, the device it was resolved for, and the optimizations
    SafeOptimizations would pretest (requested) or mark not applicable (with the reason)."""
    from hydra_train.run import check_model_flags
    from hydra_train.safe_opts.registry import build_registry

    want = cfg.runtime.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(want))
            dev = DeviceInfo("cuda", props.total_memory / 2**30, torch.cuda.is_bf16_supported())
            device_note = f"{props.name}, {dev.total_memory_gib:.0f} GiB"
        else:
            dev = ASSUMED_CUDA
            device_note = "no CUDA here: an 80 GiB bf16 GPU assumed"
    else:
        dev = DeviceInfo("cpu")
        device_note = "cpu"
    resolved = resolve_config(cfg, dev)
    check_model_flags(resolved)
    registry = build_registry(resolved)
    requested = [name for name, o in registry.items() if o.requested()]
    return {
        "device": want,
        "device_note": device_note,
        "config": resolved.to_dict(),
        "fast_path": {
            "triton_kernels": resolved.triton_kernels,
            "chunked_ce": resolved.chunked_ce,
            "cuda_graphs": resolved.experimental_cuda_graphs and dev.type == "cuda",
            "compiled_routing_glue": dev.type == "cuda",
            "compile": resolved.compile_scope if resolved.compile else False,
            "precision": resolved.precision,
        },
        "compile_reason": compile_reason(cfg, resolved, dev.type),
        "would_pretest": requested if not resolved.experimental_skip_pretest else [],
        "not_requested": [name for name in registry if name not in requested],
    }
