"""``bench tall-skinny``: matmul throughput of tall/skinny shapes ``[M, K] @ [K, N]`` (CUDA).

HYDRA's routers (N = 1 … a few), latent projections (N = a few hundred) and per-expert slices
multiply many rows by few columns. Such matmuls sit below the compute ridge and are bound by
memory: each shape is reported with its ms, TFLOP/s against a measured square matmul (the practical
compute ceiling), GB/s against the copy bandwidth, and its arithmetic intensity against the ridge
point (peak FLOP/s ÷ copy bandwidth) that says which limit applies.
"""

from __future__ import annotations

from typing import Any

import torch

from hydra_diag.loading import require_cuda_device
from hydra_diag.output import Progress, no_progress
from hydra_kernels.bench_harness import Timer, bench_setup, rand_tensor


def square_matmul_tflops(size: int, dtype: torch.dtype, dev: torch.device, timer: Timer) -> float:
    """TFLOP/s of one ``size``³ matmul: the practical compute ceiling the other shapes are set against."""
    a, b = rand_tensor(size, size, dev=dev, dt=dtype), rand_tensor(size, size, dev=dev, dt=dtype)
    return 2 * size**3 / (timer(lambda: a @ b) * 1e-3) / 1e12


def tall_skinny_bench(
    rows_m: tuple[int, ...] = (4096, 16384, 65536),
    inner_k: tuple[int, ...] = (768, 2048),
    outer_n: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512, 1024),
    dtype: torch.dtype = torch.bfloat16,
    rep: int = 30,
    device: str | None = None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Matmul ``[M, K] @ [K, N]`` for tall-skinny shapes (routers, latent projections): ms, TFLOP/s,
    GB/s, share of the copy bandwidth and of a measured large square matmul's TFLOP/s."""
    dev = torch.device(device) if device else require_cuda_device("bench tall-skinny")
    timer, copy, env = bench_setup(dev, rep)
    es = torch.empty((), dtype=dtype).element_size()
    big = 8192 if dev.type == "cuda" else 256
    progress(f"{big}^3 matmul (peak reference)")
    peak = square_matmul_tflops(big, dtype, dev, timer)
    ridge = peak * 1e12 / (copy * 1e12) if copy else None  # FLOP per byte where compute starts to bind
    rows = []
    for m in rows_m:
        for k in inner_k:
            x = rand_tensor(m, k, dev=dev, dt=dtype)
            for n in outer_n:
                progress(f"{m}x{k} @ {k}x{n}")
                w = rand_tensor(n, k, dev=dev, dt=dtype)
                ms = timer(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                flops, nbytes = 2.0 * m * n * k, (m * k + n * k + m * n) * es
                intensity = flops / nbytes
                rows.append(
                    {
                        "m": m,
                        "k": k,
                        "n": n,
                        "ms": ms,
                        "tflops": flops / (ms * 1e-3) / 1e12,
                        "gbps": nbytes / (ms * 1e-3) / 1e9,
                        "intensity": intensity,
                        "bound": None if ridge is None else ("memory" if intensity < ridge else "compute"),
                    }
                )
                r = rows[-1]
                r["pct_peak_tflops"] = 100 * r["tflops"] / peak
                r["pct_copy"] = 100 * r["gbps"] / (copy * 1e3) if copy else None
            del x
    return {
        "tool": "tall_skinny_bench",
        **env,
        "dtype": str(dtype).removeprefix("torch."),
        "square_tflops": peak,
        "square_size": big,
        "ridge_flop_per_byte": ridge,
        "rows": rows,
    }


def render_tall_skinny(result: dict[str, Any], console) -> None:
    from hydra_diag.render import rows_table

    console.print(
        rows_table(
            f"tall-skinny matmul on {result['device']} ({result['dtype']}; {result['square_size']}³ square: "
            f"{result['square_tflops']:.0f} TFLOP/s; ridge {result['ridge_flop_per_byte']} FLOP/B)",
            result["rows"],
            ["m", "k", "n", "ms", "tflops", "pct_peak_tflops", "gbps", "pct_copy", "intensity", "bound"],
            formats={"pct_peak_tflops": ".1f", "pct_copy": ".1f", "gbps": ".0f"},
        )
    )
