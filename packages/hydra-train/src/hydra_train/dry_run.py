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
    from hydra_train.data_parallel import why_not_graphed
    from hydra_train.device_setup import pick_device
    from hydra_train.options import torchrun_launch, train_options
    from hydra_train.safe_opts.registry import build_registry

    train_options()  # as a run does first: a variable it cannot use is reported here too
    launch = torchrun_launch()
    want = cfg.runtime.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if not want.startswith("cuda") or (want.startswith("cuda:") and launch.world_size > 1):
        # the run's own refusals that need no GPU: "--device tpu", "cuda:N" under torchrun
        pick_device(want, launch.local_rank, launch.world_size)
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
    resolved = resolve_config(cfg, dev)  # also refuses a flag the model config refuses
    registry = build_registry(resolved)
    requested = [name for name, o in registry.items() if o.requested()]
    graphs = bool(resolved.experimental_cuda_graphs) and dev.type == "cuda"
    if graphs and (resolved.fsdp or launch.world_size > 1):
        graphs = why_not_graphed(resolved) is None  # FSDP2 steps, DDP's reducer: never graphed
    return {
        "device": want,
        "device_note": device_note,
        "config": resolved.to_dict(),
        "fast_path": {
            "triton_kernels": resolved.triton_kernels,
            "chunked_ce": resolved.chunked_ce,
            "cuda_graphs": graphs,
            # hydra-model's routing glue: only HYDRA routes, and HYDRA_COMPILED_ROUTING=0 keeps it eager
            "compiled_routing_glue": dev.type == "cuda" and resolved.arch == "hydra" and _routing_compiled(),
            "compile": resolved.compile_scope if resolved.compile else False,
            "precision": resolved.precision,
        },
        "compile_reason": compile_reason(cfg, resolved, dev.type),
        "would_pretest": requested if not resolved.experimental_skip_pretest else [],
        "not_requested": [name for name in registry if name not in requested],
    }


def _routing_compiled() -> bool:
    """Whether hydra-model runs its routing glue compiled (its switch, HYDRA_COMPILED_ROUTING)."""
    from hydra_model import compiled_routing_enabled

    return compiled_routing_enabled()
