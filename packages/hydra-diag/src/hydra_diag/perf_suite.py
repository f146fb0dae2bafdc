"""``bench performance``: the comprehensive suite in one run (CUDA).

1. ceilings: device-to-device copy bandwidth and an 8192³ bf16 matmul;
2. kernels: ``hydra_kernels.benchmark_kernels`` (forward+backward of each op's PyTorch reference
   against the public op at a model-like size);
3. attention: causal GQA forward+backward at the preset's latent heads, through
   ``hydra_model.flexible_attention`` with each backend that is present (sdpa, auto, and flash /
   xformers when importable), and raw SDPA restricted to each of its kernels (cuDNN, flash,
   efficient); TFLOP/s counts the causal forward as 2·B·Hq·S²·d and the backward as 2.5× it;
4. model: ``bench model`` for the dynamic and dense configurations, eager.
"""

from __future__ import annotations

from typing import Any

import torch

from hydra_diag.loading import require_cuda_device
from hydra_diag.output import Progress, no_progress


def _attention_rows(
    model_size: str, batch_size: int, seq_len: int, dev: torch.device, timer
) -> tuple[list, dict]:
    import hydra_model as hm

    cfg = hm.preset_config(model_size)
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shape = f"B={batch_size} S={seq_len} Hq={hq} Hkv={hkv} d={d}"
    q = torch.randn(batch_size, hq, seq_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch_size, hkv, seq_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch_size, hkv, seq_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(q)
    flops = 2.0 * batch_size * hq * seq_len * seq_len * d * 3.5

    def step_of(fn):
        def step():
            q.grad = k.grad = v.grad = None
            fn().backward(g)

        return step

    backends = (
        ["sdpa", "auto"]
        + (["flash"] if hm.FLASH_ATTN_AVAILABLE else [])
        + (["xformers"] if hm.XFORMERS_AVAILABLE else [])
    )
    rows = []
    before = hm.attention_fallback_counts()
    previous = hm.get_attention_backend()
    try:
        for name in backends:
            hm.set_attention_backend(name)
            row: dict[str, Any] = {"impl": f"flexible_attention[{name}]", "shape": shape}
            try:
                row["ms"] = timer(step_of(lambda: hm.flexible_attention(q, k, v, causal=True)))
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    finally:
        hm.set_attention_backend(previous)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for kname in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, kname, None)
        if backend is None:
            continue
        row = {"impl": f"sdpa[{kname.lower()}]", "shape": shape}

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                )

        try:
            row["ms"] = timer(step_of(run))
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as exc:  # a kernel that rejects GQA or these shapes is a finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    after = hm.attention_fallback_counts()
    new = {k2: after.get(k2, 0) - before.get(k2, 0) for k2 in after if after.get(k2, 0) != before.get(k2, 0)}
    return rows, {"fallbacks_during_bench": new, "autotune": hm.attention_autotune_report()}


def performance_suite(
    model_size: str = "100M",
    batch_size: int = 8,
    seq_len: int = 2048,
    model_steps: int = 8,
    rep: int = 50,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Ceilings, kernels, attention backends and the model, in one report (see the module docstring)."""
    import hydra_kernels
    from hydra_diag.matmul_bench import square_matmul_tflops
    from hydra_diag.model_bench import bench_model

    dev = torch.device(device) if device else require_cuda_device("bench performance")
    from hydra_kernels.bench_harness import copy_bandwidth_tbps, timer_for

    timer = timer_for(dev, rep)
    progress("ceilings")
    copy = copy_bandwidth_tbps(dev)
    mm = square_matmul_tflops(8192, torch.bfloat16, dev, timer)
    progress("kernels")
    kernels = hydra_kernels.benchmark_kernels(batch_size=batch_size, seq_len=seq_len, dim=_dim(model_size))
    progress("attention backends")
    attn_rows, attn_info = _attention_rows(model_size, batch_size, seq_len, dev, timer)
    progress("model")
    model = bench_model(
        model_size,
        configs=("dynamic", "dense"),
        modes=("eager",),
        batch_size=batch_size,
        seq_len=seq_len,
        steps=model_steps,
        warmup=3,
        device=str(dev),
        progress=progress,
    )
    import triton

    return {
        "tool": "benchmark_performance",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "model_size": model_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "ceilings": {"copy_tbps": copy, "matmul_8192_tflops": mm},
        "kernels": [{"op": op, **r} for op, r in kernels.items()],
        "attention": attn_rows,
        "attention_info": attn_info,
        "model": model["rows"],
        "model_peak_source": model["peak_source"],
        "kernel_fallbacks": hydra_kernels.fallback_counts(),
    }


def _dim(model_size: str) -> int:
    from hydra_model import preset_config

    return preset_config(model_size).dim


def render_performance(result: dict[str, Any], console) -> None:
    from hydra_diag.render import kv_table, rows_table

    console.print(
        kv_table(
            f"performance suite on {result['device']} (torch {result['torch']}, triton "
            f"{result['triton']}), {result['model_size']} B={result['batch_size']} T={result['seq_len']}",
            result["ceilings"],
        )
    )
    console.print(
        rows_table(
            "kernels: fwd+bwd, PyTorch reference vs hydra op", result["kernels"], formats={"speedup": ".2f"}
        )
    )
    console.print(
        rows_table(
            "attention, causal fwd+bwd", result["attention"], ["impl", "shape", "ms", "tflops", "error"]
        )
    )
    if result["attention_info"]["fallbacks_during_bench"]:
        console.print(
            f"attention fallbacks: {result['attention_info']['fallbacks_during_bench']}", highlight=False
        )
    console.print(
        rows_table(
            f"model training step (MFU vs {result['model_peak_source']})",
            result["model"],
            ["config", "mode", "params", "tokens_per_s", "step_ms", "peak_gib", "tflops", "mfu", "error"],
            formats={"mfu": ".1%", "tokens_per_s": ",.0f"},
        )
    )
